"""The embedded course models: where their checkpoint folders live inside the package.

Hand-written module (not exported from a notebook). The checkpoints are trained by
`tools/train_course_model.py` and described in `docs/course_model.md`.
"""

from pathlib import Path

COURSE_MODEL_NAME = "pycoder"
ASSETS = Path(__file__).parent.parent / "assets"  # miniinfer/assets


def course_model_path(name: str = COURSE_MODEL_NAME) -> Path:
    """The folder (config.json, model.safetensors, tokenizer files) of an embedded course model:
    "pycoder" (the default) or "pycoder-draft", its small draft for speculative decoding, which
    shares its tokenizer."""
    folder = ASSETS / name
    if not (folder / "config.json").is_file():
        known = sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").is_file())
        raise ValueError(f"no embedded course model {name!r}; there are {known}")
    return folder
