"""Launches of one GaussWSLinear training call (forward + backward), before (commit 06b5c7d) and
after ∂L/∂b_i moved into the grad kernel, counted on a CPU. From the repository root:
    python results/logs_2026-12-01/gaussws_launches/count_launches.py > launches.txt
eager: TRITON_INTERPRET=1, impl="triton"; Triton launches counted where the interpreter runs a
  kernel, aten ops by a TorchDispatchMode outside those runs (the interpreter's own copies are left
  out). An aten op that is not a view or an allocation is one kernel on a GPU. On a CPU the
  counter is clone + add_ (`_next_seed_impl`); on a GPU it is one `_next_seed_kernel`.
compiled: torch.compile with AOTAutograd, Inductor's decompositions and Inductor's partitioner
  (min-cut recomputation), the Triton kernels analysed for a CUDA sm90 target (Inductor's CPU
  backend cannot run them): the forward and backward graphs Inductor would get. Inductor fuses
  the pointwise ops on the tile grid of a graph into one kernel."""
import collections, importlib, os, subprocess, sys, tempfile

OLD = "06b5c7d"
ROOT = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()
NOT_LAUNCHES = {"detach", "view", "t", "expand", "select", "alias", "empty", "new_empty", "set_",
                "_unsafe_view", "permute", "unsqueeze", "squeeze", "slice", "as_strided", "getitem"}


def load(which):
    """gaussws as it is (new) or at commit OLD under the op namespace gaussws_old (old)."""
    sys.path.insert(0, ROOT)
    if which == "new":
        return importlib.import_module("gaussws")
    src = subprocess.check_output(["git", "-C", ROOT, "show", f"{OLD}:gaussws.py"], text=True)
    src = src.replace("gaussws::", "gaussws_old::").replace("torch.ops.gaussws.", "torch.ops.gaussws_old.")
    d = tempfile.mkdtemp()
    open(os.path.join(d, "gaussws_old.py"), "w").write(src)
    sys.path.insert(0, d)
    return importlib.import_module("gaussws_old")


def eager(which):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction
    g = load(which)
    state = dict(inside=0, log=[])
    run = InterpretedFunction.run

    def counted(self, *a, **k):
        state["log"].append("triton " + self.fn.__name__)
        state["inside"] += 1
        try:
            return run(self, *a, **k)
        finally:
            state["inside"] -= 1
    InterpretedFunction.run = counted

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not state["inside"] and name not in NOT_LAUNCHES:
                state["log"].append("aten " + name)
            return func(*args, **(kwargs or {}))
    torch.manual_seed(0)
    for memory in ("save", "recompute"):
        layer = g.GaussWSLinear(64, 96, seed=3, impl="triton", memory=memory)
        x = torch.randn(8, 64)
        layer(x).sum().backward()                         # first call outside the count
        layer.zero_grad(set_to_none=True)
        out = {}
        for phase in ("forward", "backward"):
            state["log"] = []
            with Ops():
                if phase == "forward":
                    loss = layer(x).sum()
                else:
                    loss.backward()
            out[phase] = state["log"]
        for phase, log in out.items():
            c = collections.Counter(log)
            print(f"eager {which} memory={memory} {phase}: {len(log)} launches "
                  f"({sum(v for k, v in c.items() if k.startswith('triton'))} Triton): "
                  + ", ".join(f"{k} x{v}" if v > 1 else k for k, v in c.items()))


def compiled(which):
    import functools
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    g = load(which)
    os.environ["TRITON_INTERPRET"] = "1"     # gaussws' check for impl="triton" on CPU tensors only

    class Target:                             # Triton's analysis of the kernels needs a target
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)
    triton.runtime.driver.set_active(Target())
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    for memory in ("save", "recompute"):
        torch._dynamo.reset()
        got = {}

        def part(joint, inputs, **kw):
            got["forward"], got["backward"] = min_cut_rematerialization_partition(
                joint, inputs, compiler="inductor", **kw)
            return got["forward"], got["backward"]

        def stop(gm, example_inputs):
            raise RuntimeError("graphs captured")        # nothing is run
        backend = aot_autograd(fw_compiler=stop, bw_compiler=stop, partition_fn=part,
                               decompositions=select_decomp_table())
        layer = g.GaussWSLinear(64, 96, seed=3, impl="triton", memory=memory)
        f = torch.compile(lambda x: layer(x).sum(), backend=backend)
        try:
            f(torch.randn(8, 64))
        except Exception as e:
            assert "graphs captured" in str(e), e
        tiles = tuple(g.tile_grid(96, 64))
        for phase, gm in got.items():
            kernels, tile_ops = [], []
            for node in gm.graph.nodes:
                if node.op != "call_function":
                    continue
                if "triton_kernel_wrapper" in str(node.target):
                    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
                    kernels.append(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__)
                else:
                    val = node.meta.get("val")
                    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
                    if (isinstance(val, torch.Tensor) and tuple(val.shape) == tiles
                            and name not in NOT_LAUNCHES):
                        tile_ops.append(name)
            print(f"compiled {which} memory={memory} {phase}: Triton kernels {kernels}; aten ops on the "
                  f"tile grid {tiles} (Inductor: one fused kernel if any): {tile_ops or 'none'}")
        if memory == "save":
            for phase, gm in got.items():
                print(f"--- compiled {which} memory=save, {phase} graph:\n{gm.code.strip()}\n")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        {"eager": eager, "compiled": compiled}[sys.argv[1]](sys.argv[2])
    else:
        import torch, triton
        print(f"torch {torch.__version__}, triton {triton.__version__}; GaussWSLinear(64, 96), bias, "
              "x (8, 64), loss = y.sum(); second call counted\n", flush=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        for mode in ("eager", "compiled"):
            for which in ("old", "new"):
                e = dict(env, TRITON_INTERPRET="1") if mode == "eager" else env
                subprocess.run([sys.executable, __file__, mode, which], env=e, check=True,
                               stderr=subprocess.DEVNULL if mode == "compiled" else None)
                sys.stdout.flush()
