"""GaussWS's machinery (gaussws.py holds eq. 10, eq. 3/4, the seeds, bitwidths and the layer):
model surgery (surgery), Table C casts and export (export), the DiffQ / Box-Muller baselines
(baselines), torch.library ops for torch.compile (ops), tiles, noise packing, argument checks
(checks) and Triton helpers (tl)."""
