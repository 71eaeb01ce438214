"""Paper A Table 1 compiled, BF16 vs GaussWS with AdamW only (bench.bench_train), without the
GPT-2 section that `bench.py --only train --table1` runs first. Writes JSON to argv[1]."""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import bench

out = sys.argv[1]
save = lambda rows, **kw: json.dump(dict(rows=rows, **kw), open(out, "w"), indent=1)
res = bench.bench_train(optims=("adamw",), methods=("bf16", "gaussws"), compile=True, on_row=lambda rows: save(rows, partial=True))
save(res["rows"], geomean_overhead_pct=res["geomean_overhead_pct"],
     command="python results/logs_2026-12-02/table1_compiled/table1_compiled.py OUT.json")
