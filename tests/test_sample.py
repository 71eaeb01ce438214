"""examples/sample.py: loading every kind of train.py run, generation as nanoGPT's sample.py does
it, --cast against the quality harness's own numbers, --export, and the one-line refusals."""
import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import data as datamod
from examples import sample
from gaussws import GaussWSLinear, apply_pqt
from model import GPT, GPTConfig, preset_config

from tests.helpers import ROOT

pytestmark = pytest.mark.xdist_group("sample")   # one worker trains the runs once

# the kinds of run sample.py must load: flags after the shared ones below
KINDS = {"bf16": [],
         "gaussws": ["--method", "gaussws", "--optim", "zipsr"],
         "diffq-bf16": ["--method", "diffq", "--optim", "zeeden", "--param_dtype", "bf16"],
         "fsdp": ["--method", "gaussws", "--optim", "zipsr", "--grad_accum", "2", "--fsdp"],
         "gpt2": ["--tokenizer", "gpt2"]}


def gpt2_loads():
    try:
        datamod.get_tokenizer("gpt2", verbose=False)
        return True
    except RuntimeError:   # offline without TIKTOKEN_CACHE_DIR
        return False


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """{kind: out_dir} of 4-step nano runs, trained at once as `python train.py` subprocesses (the
    fsdp one on 2 gloo processes through torchrun); "gpt2" only where tiktoken's files load."""
    tmp = tmp_path_factory.mktemp("sample")
    text, data_dir = corpus
    base = ["--preset", "nano", "--max_iters", "4", "--eval_interval", "2", "--no-plot", "--batch_size", "4",
            "--eval_windows", "8", "--dataset", text, "--data_dir", data_dir, "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    datamod.prepare(text, "byte", data_dir=data_dir, verbose=False)   # once, not by each run
    procs = {}
    for kind, flags in KINDS.items():
        if kind == "gpt2" and not gpt2_loads():
            continue
        launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                  if "--fsdp" in flags else [sys.executable])
        tok = [] if "--tokenizer" in flags else ["--tokenizer", "byte"]
        procs[kind] = subprocess.Popen([*launch, "train.py", *base, *tok, *flags, "--out_dir", str(tmp / kind)],
                                       cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for kind, p in procs.items():
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0, f"train.py {kind}:\n{out[-3000:]}"
    (tmp / "empty").mkdir()
    ck = torch.load(tmp / "gaussws" / "ckpt.pt", weights_only=True)
    torch.save(dict(ck, format="gaussws-adam4bit-train-v0"), tmp / "v0.pt")
    torch.save(dict(ck, config=dict(ck["config"], tokenizer="gpt2")), tmp / "gpt2-tok.pt")
    torch.save(dict(ck, config=dict(ck["config"], dataset="/no/such/corpus.txt")), tmp / "moved.pt")
    torch.save(dict(ck, config=dict(ck["config"], eval_windows=0)), tmp / "no-val.pt")
    return {**{k: str(tmp / k) for k in procs}, "tmp": str(tmp), "corpus": text}


def run(*argv):
    return sample.main(["--device", "cpu", "--num_samples", "2", "--max_new_tokens", "16", *map(str, argv)])


def saved_model(out_dir):
    """The model state dict the run saved (a DCP folder's through dcp_to_torch_save)."""
    if os.path.isdir(os.path.join(out_dir, "ckpt")):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(os.path.join(out_dir, "ckpt"), out_dir + ".pt")
        return torch.load(out_dir + ".pt", weights_only=False)["model"]
    return torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)["model"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_run_loads_its_weights_and_tokenizer_and_samples(runs, kind):
    if kind not in runs:
        pytest.skip("tiktoken's gpt2 files do not load here (offline without TIKTOKEN_CACHE_DIR)")
    res = run("--out_dir", runs[kind], "--start", "Hello")
    assert res["path"] == os.path.join(runs[kind], "ckpt" if kind == "fsdp" else "ckpt.pt")
    assert len(res["samples"]) == 2 and all(s.startswith("Hello") for s in res["samples"])
    model, saved = res["model"], saved_model(runs[kind])
    state = model.state_dict()
    assert not model.training and sorted(state) == sorted(saved)
    assert all(torch.equal(state[k], saved[k].to(state[k].dtype)) for k in saved)   # BF16 weights exactly
    pqt = [m for m in model.modules() if isinstance(m, GaussWSLinear)]
    assert len(pqt) == (0 if kind in ("bf16", "gpt2") else 8) and not any(m.training for m in pqt)
    if kind == "gpt2":
        assert model.config.vocab_size == 50304 and len(res["samples"][0]) > len("Hello")


def test_a_llama_style_preset_is_rebuilt_with_its_rope_tables(runs, tmp_path):
    """nano-llama (RoPE, SwiGLU, q/k/v, 2 KV heads, untied head) with GaussWS on every part, saved
    as train.py saves it: rebuilt on the meta device, it computes the saved model's logits."""
    ck = torch.load(os.path.join(runs["gaussws"], "ckpt.pt"), weights_only=True)
    torch.manual_seed(0)
    model = GPT(preset_config("nano-llama", vocab_size=256))
    apply_pqt(model, method="gaussws", parts="all", seed=ck["config"]["seed"])
    torch.save(dict(ck, config=dict(ck["config"], preset="nano-llama"), model_config=asdict(model.config),
                    model=model.state_dict()), tmp_path / "llama.pt")
    res = run("--ckpt", tmp_path / "llama.pt")
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(res["model"](x, x)[0], model.eval()(x, x)[0])


def test_the_same_seed_gives_the_same_text_and_another_seed_other_text(runs):
    a, b, c = (run("--out_dir", runs["gaussws"], "--seed", s, "--max_new_tokens", 40)["samples"] for s in (3, 3, 4))
    assert a == b and a != c and a[0] != a[1]
    # the command line, from a clone: the same text, printed as nanoGPT does
    r = subprocess.run([sys.executable, "examples/sample.py", "--out_dir", runs["gaussws"], "--seed", "3",
                        "--num_samples", "2", "--max_new_tokens", "40", "--device", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith(f"{a[0]}\n---------------\n{a[1]}\n---------------\n")


def test_a_prompt_longer_than_the_block_size_is_cropped_to_its_last_block(runs, capsys):
    prompt = "".join(chr(ord("a") + i % 26) for i in range(150))     # 150 byte tokens, block size 64
    long = run("--out_dir", runs["bf16"], "--start", prompt, "--seed", 1)["samples"]
    assert "the prompt has 150 tokens: cropped to the last 64" in capsys.readouterr().out
    assert long == run("--out_dir", runs["bf16"], "--start", prompt[-64:], "--seed", 1)["samples"]
    assert long[0].startswith(prompt[-64:]) and len(long[0]) > 64


def test_a_prompt_from_a_file(runs, tmp_path):
    (tmp_path / "p.txt").write_text("def main(", encoding="utf-8")
    res = run("--out_dir", runs["bf16"], "--start", f"FILE:{tmp_path / 'p.txt'}", "--seed", 2)
    assert res["samples"] == run("--out_dir", runs["bf16"], "--start", "def main(", "--seed", 2)["samples"]


@pytest.mark.parametrize("kind", ["gaussws", "bf16"])
def test_cast_gives_the_quality_harness_numbers_bit_for_bit(runs, kind):
    """--cast tiers: cast_run's val loss before and after (a BF16 run: the control's fixed b_target
    tier); --cast e3m1: its sweep's change for e3m1; the tier shares bitwidth_stats counts."""
    from experiments.cast import cast_run
    row = cast_run(runs[kind], kind, device="cpu")["row"]
    tiers = run("--out_dir", runs[kind], "--cast", "tiers")["cast"]
    assert (tiers["val_loss_before"], tiers["val_loss_after"]) == (row["val_loss_before"], row["val_loss_after"])
    assert tiers["tier_share"] == pytest.approx(row["tier_share"], abs=1e-12)
    e3m1 = run("--out_dir", runs[kind], "--cast", "e3m1")["cast"]
    assert e3m1["val_loss_before"] == row["val_loss_before"]
    assert e3m1["val_loss_after"] - e3m1["val_loss_before"] == row["sweep_delta"]["e3m1"] != 0


def test_cast_of_a_dcp_folder_measures_the_run_s_own_val_loss(runs):
    """A --fsdp run cast: its model goes to load_run as a ckpt.pt; before the cast, the val loss
    its last eval logged (2 ranks: summed in another order)."""
    res = run("--ckpt", os.path.join(runs["fsdp"], "ckpt"), "--cast", "e2m3")
    with open(os.path.join(runs["fsdp"], "log.jsonl")) as f:
        logged = [json.loads(line) for line in f][-1]["final_val_loss"]
    assert res["cast"]["val_loss_before"] == pytest.approx(logged, abs=1e-5)
    assert res["cast"]["val_loss_after"] != res["cast"]["val_loss_before"]


def test_export_writes_a_plain_state_dict_that_loads_without_pqt(runs, tmp_path):
    path = tmp_path / "cast.pt"
    res = run("--out_dir", runs["gaussws"], "--cast", "tiers", "--export", path, "--seed", 5)
    assert os.listdir(tmp_path) == ["cast.pt"]            # written through a temp file, replaced in place
    d = torch.load(path, weights_only=True)
    assert d["cast"] == "tiers" and not any(k.endswith(("b_i", "noise_state")) for k in d["model"])
    plain = GPT(GPTConfig(**d["model_config"]))
    assert sorted(d["model"]) == sorted(plain.state_dict())
    plain.load_state_dict(d["model"])
    plain.eval()
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(x, x)[0], res["model"](x, x)[0])
    torch.manual_seed(5)     # the first sample again, from the exported model: "\n" and 16 tokens
    with torch.no_grad():
        ids = plain.generate(torch.tensor([[10]]), 16, temperature=0.8, top_k=200)[0]
    assert datamod.ByteTokenizer().decode(ids) == res["samples"][0]


REFUSED = [
    (["--out_dir", "{empty}"], "--out_dir {empty}: holds no checkpoint"),
    (["--out_dir", "{tmp}/nope"], "--out_dir {tmp}/nope: no such folder"),
    (["--out_dir", "{corpus}"], "a file; give it as --ckpt"),
    (["--ckpt", "{gaussws}/log.jsonl"], "--ckpt {gaussws}/log.jsonl: {gaussws}/log.jsonl is not a checkpoint"),
    (["--ckpt", "{corpus}"], "is not a checkpoint (not a file torch.save writes)"),
    (["--ckpt", "{tmp}/v0.pt"], "--ckpt {tmp}/v0.pt: {tmp}/v0.pt is not a train.py checkpoint (format "
                                "gaussws-adam4bit-train-v1)"),
    (["--cast", "e9m2"], "argument --cast: 'e9m2': allowed: tiers"),
    (["--cast", "fp8"], "argument --cast: 'fp8': allowed: tiers"),
    (["--max_new_tokens", "0"], "argument --max_new_tokens: '0': must be an integer >= 1"),
    (["--max_new_tokens", "-5"], "argument --max_new_tokens: '-5': must be an integer >= 1"),
    (["--num_samples", "0"], "argument --num_samples: '0': must be an integer >= 1"),
    (["--temperature", "0"], "argument --temperature: '0': must be a number > 0"),
    (["--temperature", "-1"], "argument --temperature: '-1': must be a number > 0"),
    (["--temperature", "nan"], "argument --temperature: 'nan': must be a number > 0"),
    (["--top_k", "0"], "argument --top_k: '0': must be an integer >= 1"),
    (["--start", ""], "--start '': an empty prompt"),
    (["--start", "FILE:{tmp}/nope.txt"], "--start FILE:{tmp}/nope.txt: cannot read it"),
    (["--out_dir", "{gaussws}", "--ckpt", "{gaussws}/ckpt.pt"], "argument --ckpt: not allowed with argument --out_dir"),
    (["--export", "{tmp}"], "--export {tmp}: a folder"),
    (["--ckpt", "{tmp}/no-val.pt", "--cast", "tiers"], "--cast: the run was trained with --eval_windows 0, so it "
                                                       "has no validation windows"),
]


@pytest.mark.parametrize("argv,message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_bad_input_is_refused_in_one_line(runs, capsys, argv, message):
    fill = lambda s: s.format(**runs, empty=os.path.join(runs["tmp"], "empty"))   # noqa: E731
    argv = [fill(a) for a in argv]
    if "--out_dir" not in argv and "--ckpt" not in argv:
        argv = ["--out_dir", runs["gaussws"], *argv]
    with pytest.raises(SystemExit) as e:
        sample.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("sample.py: error: "), err
    assert fill(message) in err, err


def test_what_this_machine_lacks_is_one_line(runs, monkeypatch):
    """GPT-2's tokenizer offline (data.py's line, naming TIKTOKEN_CACHE_DIR); for --cast, a run
    whose corpus is not here."""
    tiktoken = pytest.importorskip("tiktoken")

    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", os.path.join(runs["tmp"], "gpt2-tok.pt"))
    assert "trained with the GPT-2 tokenizer" in str(e.value) and "TIKTOKEN_CACHE_DIR" in str(e.value)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", os.path.join(runs["tmp"], "moved.pt"), "--cast", "tiers")
    assert "--cast needs the validation split of the run's --dataset /no/such/corpus.txt" in str(e.value)
    assert "\n" not in str(e.value)
