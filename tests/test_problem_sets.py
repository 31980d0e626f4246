"""The last part of a problem set runs the course model through the student's answers: it equals the
package's output when every exercise is answered, and names the exercise that is not."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build  # noqa: E402
from test_course import errors, execute  # noqa: E402

# For each problem set with a last part: the exercise left unanswered in the second run.
LAST_PARTS = {"01_naive_decoding": "01.apply_rope", "02_static_kv_cache": "02.cached_attention",
              "03_paged_blocks": "03.append_token",
              "04_triton_rmsnorm_rope": "04.rope_kernel", "05_paged_attention": "05.decode_program",
              "06_continuous_batching": "06.sample_rows", "07_prefix_caching": "07.chain_hashes",
              "08_serving": "08.stream_request", "09_speculative_decoding": "09.keep_accepted",
              "10_quantization": "10.gptq_columns", "11_tensor_parallelism": "11.YourRow",
              "12_sampling_and_structure": "12.prompt_rows", "13_mixture_of_experts": "13.experts_kernel",
              "14_latent_attention": "14.latent_decode_kernel", "15_disaggregation": "15.after_prefill",
              "16_scaling_out": "16.YourGuess", "17_megakernel": "17.gate_up"}


def last_part(cells: list) -> int:
    """The check cell of the last part: the problem set's last exercise, whose check runs the engine
    (or the course model) on the student's answers."""
    checks = __import__("miniinfer.course.checks").course.checks
    ids = {checks.last_part(f"{n:02}").id for n in range(1, 18)}
    return next(i for i, c in enumerate(cells) if c["metadata"].get("miniinfer", {}).get("check") in ids)


@pytest.mark.parametrize("name", LAST_PARTS)
def test_last_part_equals_the_package_when_answered(name):
    nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())
    outputs = nb["cells"][last_part(nb["cells"])]["outputs"]
    text = "".join("".join(o.get("text", "")) for o in outputs)
    assert not [o for o in outputs if o["output_type"] == "error"], outputs
    assert "\npassed:" in text or text.startswith("passed:"), text  # the stored run; nbval re-runs it


@pytest.mark.parametrize("name, missing", LAST_PARTS.items())
def test_last_part_names_the_unanswered_exercise(name, missing, tmp_path):
    nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())
    for cell in nb["cells"]:
        if cell["metadata"].get("miniinfer", {}).get("exercise") == missing:
            cell.update(build.make_exercise({"cells": [cell]})["cells"][0])
    path = tmp_path / f"{name}.ipynb"
    path.write_text(build.dump_notebook(nb))
    ran = execute(path)
    label = __import__("miniinfer.course.checks").course.checks.EXERCISES[missing].label
    assert errors(ran.cells[last_part(ran.cells)]) == [
        f"NotAnswered: {label} is not answered yet: finish it (and run its check) before this part"]
