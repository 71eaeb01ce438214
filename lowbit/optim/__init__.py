"""AdamW4bit's machinery (adam4bit.py holds the math, the reference step, the class and the kernel):
launch plan and CUDA-graph capture (plan), launch tables (launch), the kernel's lookup tables (lut),
state_dict layouts and FSDP2 views (state), argument checks (args), 16-bit parameter writes
(param_write), SR bits (sr_bits), the FP32-state step (fp32), quantization metrics (metrics)."""
