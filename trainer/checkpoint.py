"""train.py's checkpoints: ckpt.pt (atomic torch.save, plain and DDP runs) and the DCP folder ckpt
(--fsdp), their loading, and every check of --out_dir and --resume before a run starts (a
checkpoint in the way, its kind, its flags, its step). Reads and writes checkpoint files in --out_dir
(and reads the --resume path); never log.jsonl."""

import contextlib
import json
import os
import shlex
import shutil
import tempfile

import torch
import torch.distributed as dist

from lowbit import runlock
from trainer.flags import end_iter, unread_flags
from trainer.util import RunError, say

CKPT_FORMAT = "gaussws-adam4bit-train-v1"
# Run settings that may differ between a checkpoint and the run resuming it: they do not change
# what is trained, or (max_iters, tokens_per_param) they extend the run under a recomputed
# schedule; every other setting must match.
RESUME_FREE = {"resume", "stop_after", "out_dir", "compile", "compile_mode", "eval_interval", "eval_windows", "device",
               "data_dir", "plot", "overwrite", "max_iters", "tokens_per_param", "threads", "capturable",
               "activation_checkpointing", "step_in_backward"}
# flags added after checkpoints were written: their value when the checkpoint has none
RESUME_DEFAULTS = dict(param_dtype="fp32", param_rounding="rtn", master_weight_bits=None)


def run_config(args):
    return {k: v for k, v in sorted(vars(args).items())}


def check_resume_config(saved, current, path):
    """RunError listing the flags whose values differ between the checkpoint and this run (not
    those that neither reads: unread_flags, e.g. --b_init of two --method bf16 runs)."""
    saved = {**RESUME_DEFAULTS, **saved}
    unread = set(unread_flags(saved)) & set(unread_flags(current))
    keys = sorted((set(saved) | set(current)) - RESUME_FREE - unread)
    diff = [f"--{k} {saved.get(k)!r} (checkpoint) vs {current.get(k)!r} (now)"
            for k in keys if saved.get(k) != current.get(k)]
    if diff:
        raise RunError(f"--resume: {path} was written by a different configuration: {'; '.join(diff)}. "
                       f"Use the checkpoint's flags to continue it, or drop --resume to start a new run "
                       f"with these.")


def lock_out_dir(args, proc):
    """Rank 0 takes --out_dir's lock (OUT_DIR/.lock, runlock.FileLock) for the run's lifetime and
    returns it (None on other ranks); release() it on the way out (the OS releases it anyway when the
    process dies). RunError naming the holder when another live run has it; a note left by a run that
    was killed is reported and the lock taken over."""
    if not proc.master:
        return None
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise RunError(f"--out_dir {args.out_dir}: is a file, not a folder; name a folder (it is created)")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        raise RunError(f"--out_dir {args.out_dir}: cannot write there ({e.strerror or e})") from None
    lock = runlock.FileLock(os.path.join(args.out_dir, ".lock"))
    try:
        stale = lock.acquire(wait=False)
    except runlock.Locked as e:
        raise RunError(f"--out_dir {args.out_dir} is in use by another run ({runlock.describe(e.holder)}): "
                       f"wait for it to end, or give this run another --out_dir") from None
    except OSError as e:
        raise RunError(f"--out_dir {args.out_dir}: cannot lock it ({e.strerror or e})") from None
    if stale:
        say(f"--out_dir {args.out_dir}: the run that held it ({runlock.describe(stale)}) ended without "
            f"releasing it (killed?); its last checkpoint is intact")
    return lock


def _inside(path, folder):
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) == os.path.realpath(folder)


def check_out_dir(args, proc):
    """RunError (one line) before any data or model: a fresh run would replace a checkpoint of either
    kind in --out_dir (without --overwrite), --overwrite would remove the checkpoint --resume loads,
    or --out_dir cannot be created or written (with the reason)."""
    found = checkpoints_in(args.out_dir)
    if args.resume and args.overwrite and (args.resume == "auto" or _inside(resume_path(args), args.out_dir)):
        raise RunError(f"--overwrite with --resume {args.resume}: it would remove the checkpoint it resumes; "
                       f"drop --overwrite to continue the run in --out_dir {args.out_dir}")
    if not args.resume and not args.overwrite and found:
        if found == [os.path.join(args.out_dir, "ckpt.tmp")] and not dcp_complete(found[0]):
            raise RunError(f"--out_dir {args.out_dir} holds only {found[0]}, an FSDP2 checkpoint whose writing "
                           f"did not finish (the run stopped before its first checkpoint was complete): nothing to "
                           f"resume; start over with --overwrite (removes it and replaces log.jsonl)")
        kind, how = ckpt_kind(found[0])
        how = "--resume" if os.path.isdir(found[0]) == args.fsdp else how
        raise RunError(f"--out_dir {args.out_dir} holds {kind} ({found[0]}): continue that run with {how}, "
                       f"or start over with --overwrite (removes it and replaces log.jsonl)")
    if not proc.master:
        return
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=args.out_dir) as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise RunError(f"--out_dir {args.out_dir}: cannot write there ({e.strerror or e})") from None


def check_resume_target(args):
    """RunError (one line) when --resume PATH from another folder would continue into an --out_dir
    that holds another run's checkpoint or log.jsonl (without --overwrite): its checkpoint would be
    replaced and the two runs' records mixed in one log. Called once PATH has loaded, so a bad
    file is named first."""
    if not args.resume or args.resume == "auto" or args.overwrite or _inside(resume_path(args), args.out_dir):
        return
    log = os.path.join(args.out_dir, "log.jsonl")
    theirs = checkpoints_in(args.out_dir) + ([log] if os.path.exists(log) else [])
    if theirs:
        raise RunError(f"--out_dir {args.out_dir} holds another run's {'log' if theirs[0] == log else 'checkpoint'} "
                       f"({theirs[0]}): continuing {resume_path(args)} there would replace it and mix the two "
                       f"runs' log.jsonl; give the continuation an --out_dir of its own, or add --overwrite "
                       f"to replace what is there")


def ckpt_path(args, folder=None):
    """OUT_DIR/ckpt.pt, or under --fsdp the DCP folder OUT_DIR/ckpt (in `folder` instead of OUT_DIR)."""
    return os.path.join(folder or args.out_dir, "ckpt" if args.fsdp else "ckpt.pt")


# what a run may leave in --out_dir: ckpt.pt (plain and DDP runs), the DCP folder ckpt (--fsdp) and
# save_dcp_checkpoint's ckpt.tmp / ckpt.old; a fresh run refuses any of them, --overwrite removes all
CKPT_NAMES = ("ckpt.pt", "ckpt", "ckpt.old", "ckpt.tmp")


def checkpoints_in(out_dir):
    """The paths of CKPT_NAMES present in out_dir (a list, in that order; [] when none)."""
    return [p for p in (os.path.join(out_dir, n) for n in CKPT_NAMES) if os.path.exists(p)]


def ckpt_kind(path, resume="--resume"):
    """(kind, how to resume it) of a checkpoint path: the two kinds are not interchangeable. The
    command has placeholders: the flags of the run that wrote it (resume checks them against the
    checkpoint) and N processes; `resume` is its --resume flag (with the path a run was given)."""
    if os.path.isdir(path):
        return "an FSDP2 checkpoint", ("torchrun --standalone --nproc_per_node N train.py <that run's flags> --fsdp "
                                       f"{resume} (N dividing its --grad_accum)")
    return "a plain checkpoint", f"python train.py <that run's flags> {resume}, without --fsdp (torchrun for DDP)"


def resume_path(args):
    """The checkpoint --resume loads: OUT_DIR's (ckpt.pt, or under --fsdp the DCP folder ckpt), or
    --resume PATH: a checkpoint, or a run's --out_dir (its checkpoint of this run's kind)."""
    folder = args.out_dir if args.resume == "auto" else args.resume
    if args.resume != "auto" and not (os.path.isdir(folder) and checkpoints_in(folder)):
        return args.resume
    path = ckpt_path(args, folder)
    if os.path.exists(path):
        return path
    # a DCP folder is replaced by two renames (save_dcp_checkpoint): a crash between them leaves the
    # new checkpoint complete as ckpt.tmp (train.json, written last, in it) and the previous one as
    # ckpt.old; a crash before them (a first save) a complete ckpt.tmp alone
    if dcp_complete(path + ".tmp"):
        return path + ".tmp"
    return path + ".old" if os.path.isdir(path + ".old") else path


def dcp_complete(path):
    """True if the DCP folder `path` was written to the end (save_dcp_checkpoint adds its
    train.json last)."""
    return os.path.isfile(os.path.join(path, "train.json"))


def check_resume_kind(args):
    """RunError (one line) before anything is loaded when --resume would load the other kind of
    checkpoint than this run writes (a DCP folder without --fsdp, a ckpt.pt with it), or finds
    none of its kind where one of the other kind lies."""
    path, this = resume_path(args), "an FSDP2 (--fsdp)" if args.fsdp else "a plain"
    given = lambda p: "--resume" if args.resume == "auto" else f"--resume {shlex.quote(p)}"   # noqa: E731
    if os.path.exists(path):
        if os.path.isdir(path) != args.fsdp:
            kind, how = ckpt_kind(path, given(path))
            raise RunError(f"--resume: {path} is {kind}, not {this} one: resume it with {how}")
        return
    folder = os.path.dirname(path)
    other = [p for p in checkpoints_in(folder) if os.path.isdir(p) != args.fsdp and not p.endswith(".tmp")]
    if other:
        kind, how = ckpt_kind(other[0], given(other[0]))
        raise RunError(f"--resume: {folder} holds {kind} ({other[0]}), not {this} one: resume it with {how}")


def resume_is_done(args, ckpt, has_summary=True):
    """True (with a message) when the checkpoint is already at the step this run would stop at
    (checked once --max_iters is known), unless the log lacks the summary such a run ends with
    (has_summary=False: cut off mid-write; the run goes on for zero steps and writes it). RunError
    when it was written with other flags."""
    check_resume_config(ckpt["config"], run_config(args), resume_path(args))
    if ckpt["iter_num"] < end_iter(args):
        return False
    if not has_summary:
        say(f"--resume: {resume_path(args)} is at step {ckpt['iter_num']}, where this run ends, and "
            f"{os.path.join(args.out_dir, 'log.jsonl')} has no summary (cut off?): writing it")
        return False
    finished = ckpt["iter_num"] >= args.max_iters
    if ckpt["iter_num"] == args.max_iters:
        state = f"at step {ckpt['iter_num']} of {args.max_iters}, the run is finished"
    elif finished:
        state = f"at step {ckpt['iter_num']}, past --max_iters {args.max_iters}"
    else:
        state = f"at step {ckpt['iter_num']}, already at --stop_after {args.stop_after}"
    say(f"--resume: {resume_path(args)} is {state}"
        + f"; nothing to do ({os.path.join(args.out_dir, 'log.jsonl')} is left as it is). "
        + ("Raise --max_iters to train longer, or use --overwrite or a new --out_dir to start over."
           if finished else "Raise or drop --stop_after to go on."))
    return True


def load_state(ckpt, model, optimizer, device_type, path):
    """Load model, optimizer and RNG state from a checkpoint of load_checkpoint into this run's
    model and optimizer (a DCP folder's resharded to this run's ranks). RunError (one line, naming
    `path`, the checkpoint --resume found) when it cannot be read or does not fit."""
    try:
        if "dcp" in ckpt:   # DCP reshards to this run's number of ranks
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
            state = dcp_state(model, optimizer, {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()
                                                 if device_type == "cuda" else None})
            try:
                dcp.load(state, checkpoint_id=ckpt["dcp"])
            except (Exception, dcp.CheckpointException) as e:   # on every rank: DCP gathers the ranks' errors
                raise RunError(f"--resume: checkpoint {ckpt['dcp']} cannot be read (corrupt or truncated?): "
                               f"{one_line(e)}") from None
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
            ckpt = dict(ckpt, rng=state["rng"])
        else:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device_type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    except (KeyError, RuntimeError, ValueError, TypeError) as e:   # a checkpoint edited by hand
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RunError(f"--resume {path}: the checkpoint does not fit this model and "
                       f"optimizer ({type(e).__name__}: {msg[:200]})") from None


def atomic_write(path, write, mode="wb"):
    """write(f) into path + '.tmp', fsync, then os.replace onto path: a crash mid-write leaves the
    previous file intact. On an error the temp file is removed and the error raised again."""
    tmp = path + ".tmp"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def save_checkpoint(path, obj):
    """torch.save through atomic_write: a crash mid-write leaves the previous checkpoint intact."""
    atomic_write(path, lambda f: torch.save(obj, f))


def dcp_state(model, optimizer, rng):
    """The state dict of a DCP checkpoint: model and optimizer (torch.distributed.checkpoint's
    get_model/optimizer_state_dict: sharded DTensors, resharded on load) and the RNG states."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
            "rng": {k: v for k, v in rng.items() if v is not None}}


def save_dcp_checkpoint(path, meta, model, optimizer, rng, master):
    """Every rank: write the DCP folder `path` for step meta["iter_num"] atomically: dcp.save into
    path.tmp, rank 0 adds train.json (meta: step, config, ...), then replaces path by two renames
    (path -> path.old, path.tmp -> path; after a crash between them resume_path takes the complete
    path.tmp, else path.old) and removes path.old. A collective: every rank calls it at the same step."""
    import torch.distributed.checkpoint as dcp
    tmp, old = path + ".tmp", path + ".old"
    if master and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(dcp_state(model, optimizer, rng), checkpoint_id=tmp)
    dist.barrier()
    if master:
        atomic_write(os.path.join(tmp, "train.json"), lambda f: f.write(json.dumps(meta)), "w")
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    dist.barrier()


def load_dcp_meta(path):
    """train.json of the DCP folder `path` (the checkpoint minus model, optimizer and RNG, which
    resume() loads once they exist), with "dcp": path; RunError when it is missing or not ours."""
    try:
        with open(os.path.join(path, "train.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise RunError(f"--resume: {path} is not a complete train.py --fsdp checkpoint folder "
                       f"(train.json: {getattr(e, 'strerror', None) or e})") from None
    if not isinstance(meta, dict) or meta.get("format") != CKPT_FORMAT:
        raise RunError(f"--resume: {path} is not a train.py checkpoint (format {CKPT_FORMAT})")
    check_dcp_files(path)
    return dict(meta, dcp=path)


def one_line(e):
    """'Type: first line of the message' (at most 200 characters) of an exception; of a DCP
    CheckpointException, that of the first failed rank's exception, which it wraps."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (e, _) = min(failures.items())
        return f"rank {rank}: {one_line(e)}"
    msg = str(e)
    if "WeightsUnpickler error:" in msg:   # skip torch.load's advice on weights_only=False
        msg = msg.split("WeightsUnpickler error:")[1].strip()
    msg = (msg.strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {msg[:200]}"


def check_dcp_files(path):
    """RunError (one line, naming the folder and the file) unless the DCP folder's .metadata reads
    and every byte range it lists lies in a present .distcp file: a deleted or truncated file is
    reported before any model is built, on every rank alike."""
    from torch.distributed.checkpoint import FileSystemReader
    bad = f"--resume: checkpoint {path} cannot be read (corrupt or truncated?)"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise RunError(f"{bad}: its .metadata is missing")
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as e:
        raise RunError(f"{bad}: .metadata: {one_line(e)}") from None
    need = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(need.items()):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            raise RunError(f"{bad}: {name} is missing")
        if os.path.getsize(f) < end:
            raise RunError(f"{bad}: {name} has {os.path.getsize(f)} bytes, its .metadata needs {end}")


def load_checkpoint(path):
    """Read a checkpoint written by save_checkpoint (or the train.json of a DCP folder); RunError
    with the reason when it is missing, unreadable (corrupt/truncated) or not one of ours."""
    if not os.path.exists(path):
        tmp = path + ".tmp"   # a DCP save cut before its final rename
        raise RunError(f"--resume: no checkpoint at {path}" + (
            f" ({tmp} is complete: --resume {shlex.quote(tmp)})" if dcp_complete(tmp) else
            f" (only {tmp}, whose writing did not finish: start over with --overwrite)" if os.path.isdir(tmp) else ""))
    if os.path.isdir(path):
        return load_dcp_meta(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic and not (magic.startswith(b"PK") or magic.startswith(b"\x80")):   # torch.save: a zip (or a pickle)
        raise RunError(f"--resume: {path} is not a checkpoint (not a file torch.save writes); give a run's "
                       f"ckpt.pt or its --out_dir")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        # one line: the reason, without PyTorch's advice on weights_only=False (never for a checkpoint
        # we did not write: unpickling runs code)
        msg = str(e)
        if "WeightsUnpickler error:" in msg:
            detail = msg.split("WeightsUnpickler error:")[1].strip().splitlines()[0].split(". ")[0]
            reason = f"it holds objects a weights-only load refuses: {detail}"
        elif os.path.getsize(path) == 0:
            reason = "the file is empty"
        else:
            reason = f"{type(e).__name__}: {(msg.splitlines() or [''])[0].split('. ')[0][:200]}"
        raise RunError(f"--resume: checkpoint {path} cannot be read (corrupt or truncated?): {reason}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise RunError(f"--resume: {path} is not a train.py checkpoint (format {CKPT_FORMAT})")
    return ckpt
