"""The embedded course model: where its checkpoint folder lives inside the package.

Hand-written module (not exported from a notebook). The checkpoint is trained by
`tools/train_course_model.py` and described in `docs/course_model.md`.
"""

from pathlib import Path

COURSE_MODEL_NAME = "pycoder"


def course_model_path() -> Path:
    """The folder of the embedded course model (config.json, model.safetensors, tokenizer files)."""
    return Path(__file__).parent / "assets" / COURSE_MODEL_NAME
