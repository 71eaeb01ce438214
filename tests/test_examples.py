"""examples/finetune_hf.py (needs transformers and accelerate) and README.md: its Python blocks run
as pasted, its train.py commands each write their own --out_dir."""
import argparse
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

import gaussws as g
from lowbit.pqt.export import cast_tiles
from trainer.flags import build_parser

from tests.helpers import ROOT


# ---------------------------------------------------------------------------------------------
# examples/finetune_hf.py: the Hugging Face example (needs transformers and accelerate)

def test_finetune_hf_example_writes_a_plain_model_that_loads_without_this_repo(tmp_path, monkeypatch, capsys):
    tf = pytest.importorskip("transformers", reason="finetune_hf.py needs transformers and accelerate")
    from examples import finetune_hf
    monkeypatch.setenv("OMP_NUM_THREADS", "1")        # main leaves the test's thread count alone
    text = tmp_path / "corpus.txt"
    text.write_text(open(argparse.__file__, encoding="utf-8").read()[:40000], encoding="utf-8")
    out = tmp_path / "plain"
    before, after = finetune_hf.main(["--text", str(text), "--max_steps", "3", "--batch_size", "2",
                                      "--block_size", "32", "--cast", "e3m4", "--out", str(out)])
    assert before < math.log(256) and math.isfinite(after)
    model = tf.AutoModelForCausalLM.from_pretrained(str(out))
    assert not [k for k in model.state_dict() if k.endswith(("b_i", "noise_state"))]
    assert not g.pqt_layers(model)
    # every sampled weight holds e3m4 values, tile by tile; the embedding is as trained
    w = model.model.layers[0].mlp.up_proj.weight.detach()
    assert torch.equal(cast_tiles(w, 3, 4), w)
    assert not torch.equal(cast_tiles(model.model.embed_tokens.weight.detach(), 3, 4),
                           model.model.embed_tokens.weight)
    for argv, msg in ((["--cast", "fp8"], "--cast 'fp8'"), (["--max_steps", "0"], "--max_steps 0"),
                      ([], "no such file")):
        with pytest.raises(SystemExit):
            finetune_hf.parse_args(["--text", str(text) if argv else "/no/such.txt", *argv])
        assert msg in capsys.readouterr().err


def test_finetune_hf_rejects_bad_inputs_in_one_line_before_training(tmp_path, capsys):
    from examples import finetune_hf
    text = tmp_path / "corpus.txt"
    text.write_text("some text\n" * 50, encoding="utf-8")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "afile").write_text("x")
    for argv, msg in ((["--parts", "foo"], "--parts 'foo': unknown part(s) ['foo']"),
                      (["--b_init", "3", "--b_target", "4"], "--b_target 4.0 > b_init=3.0"),
                      (["--lr", "-1"], "--lr -1.0: must be a finite number > 0"),
                      (["--text", str(tmp_path / "bin.txt")], "is not UTF-8 text"),
                      (["--text", str(tmp_path / "empty.txt")], "is empty"),
                      (["--text", str(tmp_path)], "is a folder"),
                      (["--out", str(tmp_path / "afile")], "is a file"),
                      (["--model", "not a/model id!"], "neither a local folder nor a Hugging Face model id")):
        with pytest.raises(SystemExit):
            finetune_hf.parse_args(["--text", str(text), *argv])
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (argv, err)
    assert finetune_hf.parse_args(["--text", str(text), "--cast", "none", "--parts", "q_proj,o_proj"]).cast is None
    with pytest.raises(SystemExit):
        finetune_hf.parse_args(["--help"])
    assert "tokenizer when --model is given" in " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------------------------------------
# README.md: its code runs as pasted, its commands in the order shown

def readme_blocks(lang):
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("i", range(3))
def test_readme_python_block_runs_as_pasted(i, tmp_path):
    blocks = readme_blocks("python")
    assert len(blocks) == 3                        # AdamW4bit loop, apply_pqt, Hugging Face
    if "transformers" in blocks[i]:
        pytest.importorskip("transformers", reason="the Hugging Face block needs transformers and accelerate")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")   # from another folder, as after pip install
    r = subprocess.run([sys.executable, "-c", blocks[i]], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_readme_train_commands_each_write_their_own_out_dir():
    # run in the order shown, a fresh run into a folder holding a checkpoint is refused; only --resume reuses one
    seen = set()
    for block in readme_blocks("bash"):
        for line in block.splitlines():
            for cmd in line.split("#")[0].split("&&"):
                argv = shlex.split(cmd)
                if "train.py" not in argv:
                    continue
                args = build_parser().parse_args(argv[argv.index("train.py") + 1:])
                if args.resume is None:
                    assert args.out_dir not in seen, f"README: {cmd.strip()!r} reuses --out_dir {args.out_dir}"
                    seen.add(args.out_dir)
                else:
                    assert args.out_dir in seen, f"README: {cmd.strip()!r} resumes a folder no command wrote"
    assert len(seen) >= 5
