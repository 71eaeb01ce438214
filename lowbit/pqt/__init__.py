"""GaussWS's machinery (gaussws.py holds eq. 10, eq. 3/4, the seeds, bitwidths, the layer and
apply_pqt / remove_pqt, and hands its layer classes down): model surgery (surgery), Table C casts
and export (export), the DiffQ / Box-Muller baselines (baselines), torch.library ops for
torch.compile (ops), tiles, noise packing, argument checks (checks) and Triton helpers (tl)."""
