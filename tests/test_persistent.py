"""The persistent decode step's prototype (issue 74, tools/proto_megakernel.py): every task of a step, dealt
to one program in their global order (Triton's interpreter runs programs one after another, so programs
that wait on each other cannot run here), gives the step's logits in float32, five positions in a row."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import proto_megakernel  # noqa: E402


def test_one_program_running_every_task_in_order_gives_the_steps_logits(capsys):
    proto_megakernel.check()
    assert capsys.readouterr().out.count("argmax same: True") == 5
