"""Fixtures shared by the test files: a real-text corpus, and the FSDP2 runs of tests/fsdp.py."""
import argparse

import pytest

from tests.fsdp import load_and_continue, train_and_save, unwrapped_dcp_round_trip
from tests.helpers import launch_ranks


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A ~100 kB real-text file (argparse's source) and a data folder for prepared datasets."""
    d = tmp_path_factory.mktemp("corpus")
    path = d / "corpus.txt"
    path.write_text(open(argparse.__file__, encoding="utf-8").read(), encoding="utf-8")
    return str(path), str(d / "data")


@pytest.fixture(scope="session")
def fsdp_runs(tmp_path_factory):
    """The 2-rank run with its checkpoints; the runs that load them on 1 and on 2 ranks and into
    an unwrapped model; 2 ranks loading the unwrapped model's checkpoint. Computed once per worker
    process: the tests that read it share the pytest-xdist group "fsdp_runs"."""
    tmp = tmp_path_factory.mktemp("fsdp")
    saved = launch_ranks(train_and_save, tmp, 2)
    one, two = launch_ranks(load_and_continue, tmp, 1), launch_ranks(load_and_continue, tmp, 2)
    unwrapped = unwrapped_dcp_round_trip(tmp)
    return saved, one, two, unwrapped, launch_ranks(load_and_continue, tmp, 2, "dcp-plain")
