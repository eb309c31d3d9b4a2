"""The data layer: prompt files (:mod:`.prompt_files`) and the prompt sources that draw each iteration's
prompts from a file or a procedural world (:mod:`.sources`)."""

from .prompt_files import MAX_PROMPT_CHARS, MAX_PROMPT_FILE_BYTES, check_prompt_file, load_prompt_file
from .sources import PROCEDURAL_PROMPTS, PromptBatch, PromptSource

__all__ = ["MAX_PROMPT_CHARS", "MAX_PROMPT_FILE_BYTES", "PROCEDURAL_PROMPTS", "PromptBatch", "PromptSource",
           "check_prompt_file", "load_prompt_file"]
