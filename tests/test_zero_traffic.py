"""ZeRO's communication volume per step (Rajbhandari et al. 2020, section 7): 2Psi for stages
0-2, 3Psi for stage 3, in ring bytes per rank, for dense models under data parallelism."""

import pytest

from properties import check_zero
from stg.api import build
from stg.plan import Plan
from test_pipeline_matrix import FAMILIES

CASES = [(family, zero, dp) for family in ("llama", "gpt") for zero in (0, 1, 2, 3) for dp in (2, 4)]


@pytest.mark.parametrize("family, zero, dp", CASES)
def test_zero_ring_traffic(family, zero, dp):
    check_zero(build(FAMILIES[family], Plan(dp=dp, zero=zero, global_batch=dp, seq=32)))
