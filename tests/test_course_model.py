"""The embedded course model: what ships, that transformers loads it offline, and its pinned output."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import miniinfer as mi

ROOT = Path(__file__).resolve().parent.parent

# Greedy continuations of the shipped checkpoint: any change to weights or tokenizer shows here.
PINNED = {
    "def fibonacci(n):": [278, 388, 323, 199, 199, 534, 293, 8, 88, 289, 278, 388, 596, 199, 199, 534],
    "import os\n": [604, 656, 199, 604, 3063, 199, 604, 941, 199, 618, 345, 14, 1173, 568, 550, 63],
}


def test_checkpoint_files_and_size():
    folder = mi.course_model_path()
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in folder.iterdir()) < 25e6
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA, for the course to teach
    assert cfg["tie_word_embeddings"] and cfg["max_position_embeddings"] >= 1024


def test_pinned_greedy_completion():
    model, tok = mi.load_model(), mi.load_tokenizer()
    for prompt, expected in PINNED.items():
        params = mi.SamplingParams(temperature=0, max_tokens=len(expected))
        assert mi.generate_naive(model, tok(prompt).input_ids, params) == expected, prompt


def test_transformers_loads_it_offline():
    code = (
        "import torch, miniinfer as mi\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "p = mi.course_model_path()\n"
        "tok = AutoTokenizer.from_pretrained(p)\n"
        "m = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)\n"
        "ids = tok('import os\\n', return_tensors='pt').input_ids\n"
        "out = m.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]\n"
        "print(out.tolist(), tok.eos_token)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"{PINNED['import os' + chr(10)]} <|endoftext|>"


def test_package_data_ships_the_checkpoint():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"assets/*/*"' in text


def test_training_script_runs_tiny_on_cpu(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import train_course_model
    finally:
        sys.path.pop(0)
    log = train_course_model.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)])
    assert log["val_loss"][-1][1] < log["val_loss"][0][1]  # it learns something in 4 steps
    assert (tmp_path / "val_loss.png").exists()
    model, tok = mi.load_model(tmp_path), mi.load_tokenizer(tmp_path)
    assert model.cfg.vocab_size == len(tok) and tok.eos_token == "<|endoftext|>"
    assert isinstance(model(torch.tensor([tok("x = 1").input_ids])), torch.Tensor)


def test_corpus_builder_filters_dedups_and_splits_by_package(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import course_corpus
    finally:
        sys.path.pop(0)
    import zipfile

    def fake_wheel(name, version, dest):  # what pip would download, without the network
        path = dest / f"{name}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"{name}/__init__.py", f"NAME = {name!r}\n")
            z.writestr(f"{name}/shared.py", "def shared():\n    return 1\n")  # in both: kept once
            z.writestr(f"{name}/table.py", "DATA = '" + "x" * 5000 + "'\n")    # generated: dropped
            z.writestr(f"{name}/empty.py", "\n")
            z.writestr(f"{name}-{version}.dist-info/METADATA", "Name: x\nLicense-Expression: MIT\n\n")
        return path

    monkeypatch.setattr(course_corpus, "download", fake_wheel)
    monkeypatch.setattr(course_corpus, "PACKAGES", [("alpha", "1.0", "MIT"), ("click", "2.0", "MIT")])
    manifest = course_corpus.build(tmp_path, only=["alpha", "click"])
    train, val = course_corpus.read_split(tmp_path, "train"), course_corpus.read_split(tmp_path, "val")
    assert [d["path"] for d in train] == ["alpha/__init__.py", "alpha/shared.py"]
    assert [d["path"] for d in val] == ["click/__init__.py"]  # held out; its shared.py is a duplicate
    assert [s["license_in_metadata"] for s in manifest["sources"]] == ["MIT", "MIT"]
    assert manifest["sources"][1]["duplicates_dropped"] == 1


def test_completion_scorer_cuts_at_the_dedent_and_counts_statements():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import eval_course_model as ev
    finally:
        sys.path.pop(0)
    assert len(ev.PROMPTS) == 20 and all(p.endswith('"""\n') and p.count("\n") == 2 for p in ev.PROMPTS)
    prompt = ev.PROMPTS[14]  # is_prime
    good = "    if n < 2:\n        return False\n    return all(n % d for d in range(2, n))\n\ndef other():\n    pas"
    assert ev.writes_a_body(ev.cut_body(prompt, good, finished=False))
    cut_mid_line = "    if n < 2:\n        return False\n    return all(n % d for d in ra"
    assert ev.cut_body(prompt, cut_mid_line, finished=False).endswith("return False\n")
    assert ev.writes_a_body(ev.cut_body(prompt, cut_mid_line, finished=False))
    assert not ev.writes_a_body(ev.cut_body(prompt, "    return n\n    return n\n", finished=True))  # one statement
    assert not ev.writes_a_body(ev.cut_body(prompt, "\n# a comment\ndef f():\n", finished=True))    # no body
    assert not ev.writes_a_body(ev.cut_body(prompt, "    if n:\n", finished=True))                 # no parse
