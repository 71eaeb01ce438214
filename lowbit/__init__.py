"""The engine under the two papers' files (adam4bit.py, gaussws.py): shared numerics and Philox,
`optim/` (AdamW4bit's machinery), `pqt/` (GaussWS's machinery). Imports nothing above it."""
from lowbit.in_backward import step_in_backward  # noqa: F401
