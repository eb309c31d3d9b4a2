"""Model recipes: the model, data, reward, evaluation and budget settings of one model family (``*.yaml`` beside this file)."""
