"""Absurd model configurations are refused before allocation (issue 43, "a new hostile round", item 1).

A shapes weights folder or a diffusers pipeline folder whose config says ``num_layers: 1000000`` grew
past 1.5 GiB of RSS while the model was built (2.7 GB after 60 s for the shapes model, still
growing). Now one check (:mod:`flowgrpo.model_size`), called by the shapes loader and by
``load_pipeline`` for every model component, counts the parameters the config describes on the meta
device, stops once they pass what the weight files hold, and refuses in one line naming the config
file, its largest setting and both numbers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_env

from flowgrpo.errors import UserError
from flowgrpo.model_size import check_model_folder, check_pipeline_folder, count_parameters, stored_values


def test_counting_stops_at_the_limit():
    built = []

    def build():
        return torch.nn.ModuleList(built.append(i) or torch.nn.Linear(100, 100) for i in range(10**6))

    assert count_parameters(build, 50_000) == 50_001
    assert len(built) == 5  # 5 x 10,100 parameters: the sixth layer was never made
    assert count_parameters(lambda: torch.nn.Linear(100, 100), 50_000) == 10_100


def test_a_folder_whose_config_fits_its_weights_passes(shapes_model_dir, tmp_path):
    from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline
    from flowgrpo.shapes.model import ShapesFlowModel

    assert stored_values(shapes_model_dir) == sum(p.numel() for p in ShapesFlowModel.load(shapes_model_dir).state_dict().values())
    tiny_sd3_pipeline(seed=0).save_pretrained(tmp_path / "p")
    check_pipeline_folder(tmp_path / "p")
    check_pipeline_folder("stabilityai/not-a-local-folder")  # a hub id: left to the loader
    with pytest.raises(UserError, match=r"describes a model of more than 1,048,\d+ parameters \(its largest setting: "
                                        r"width=1000\), but the weight files in .* hold 2 values"):
        (tmp_path / "w").mkdir()
        (tmp_path / "w" / "x.bin").write_bytes(b"0")
        check_model_folder(tmp_path / "w", tmp_path / "w" / "config.json", {"width": 1000, "on": True},
                           lambda: torch.nn.Linear(1000, 1000) and torch.nn.Linear(1100, 1000))


HOSTILE = """
import json, resource, sys
from pathlib import Path
from flowgrpo.errors import UserError
from flowgrpo.shapes.model import ShapesFlowModel
from flowgrpo.config import load_config
from flowgrpo.policies import build_policy

root = Path(sys.argv[1])
print("imports_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
def sd3(folder):
    return load_config("shapes", None, ["model.name=sd3", f"model.path={folder}", "model.resolution=64",
                                        "model.max_sequence_length=16"], recipe="shapes").model
for what, load in [("shapes", lambda: ShapesFlowModel.load(root / "shapes")),
                   ("transformer", lambda: build_policy(sd3(root / "transformer"))),
                   ("text_encoder", lambda: build_policy(sd3(root / "text_encoder")))]:
    try:
        load()
        print(what, "LOADED")
    except UserError as exc:
        print(what, exc)
print("maxrss_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def set_key(config: Path, key: str, value, nested: str | None = None) -> None:
    data = json.loads(config.read_text())
    (data[nested] if nested else data)[key] = value
    config.write_text(json.dumps(data))


def test_absurd_sizes_are_refused_before_allocation(shapes_model_dir, tmp_path):
    """Three folders, each with one absurd size: the shapes model's num_layers, an SD3 pipeline's
    transformer num_layers (diffusers) and its CLIP text encoder's num_hidden_layers (transformers).
    Each is refused in one line, all three within seconds and without the memory they describe."""
    from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline

    shutil.copytree(shapes_model_dir, tmp_path / "shapes")
    set_key(tmp_path / "shapes" / "config.json", "num_layers", 1_000_000, nested="config")
    pipe = tiny_sd3_pipeline(seed=0)
    for name, key in (("transformer", "num_layers"), ("text_encoder", "num_hidden_layers")):
        pipe.save_pretrained(tmp_path / name)
        set_key(tmp_path / name / name / "config.json", key, 1_000_000)
    proc = subprocess.run([sys.executable, "-c", HOSTILE, str(tmp_path)], capture_output=True, text=True,
                          env=cli_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.strip())
    for what, config, key in (("shapes", tmp_path / "shapes" / "config.json", "num_layers"),
                              ("transformer", tmp_path / "transformer" / "transformer" / "config.json", "num_layers"),
                              ("text_encoder", tmp_path / "text_encoder" / "text_encoder" / "config.json",
                               "num_hidden_layers")):
        assert lines[what].startswith(f"{config} describes a model of more than "), lines[what]
        assert f"(its largest setting: {key}=1000000)" in lines[what] and f"weight files in {config.parent} hold" in lines[what]
    # the peak over the imports' own: the tiny pipelines' configs only, never the 10^6-layer models
    # (each would need far more than a GiB); the imports' size varies with the libraries installed
    assert int(lines["maxrss_mib"]) - int(lines["imports_mib"]) < 1024, proc.stdout
