"""The pieces of the peer adapters and of ``findings.md`` that need no peer installed: the refusal of views
strided where a peer kernel takes no stride (``peers.refuse_unread_strides``), the page's summary by suite
family (``findings_page.family_lines``), and the base adapter's "not supported" for an operation an fp8
adapter lacks."""

from __future__ import annotations

import pytest
import torch
from pagedbench.conformance.adapter import NotSupported
from pagedbench.conformance.peers import refuse_unread_strides
from pagedbench.conformance.peers.findings_page import FamilyReview, Finding, family_lines


def _every_other(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(*t.shape, 2, dtype=t.dtype)[..., 0]


@pytest.mark.parametrize(
    "dims,tensor",
    [
        (1, torch.arange(6)),  # dense lengths
        (1, torch.zeros(8)[::3][:1]),  # one element (stride 3): no stride to get wrong
        (1, torch.zeros(3, 4, 8)[:, :2]),  # a slice of a fused projection's heads: rows wider, dims dense
        (2, torch.zeros(3, 4, 8)[1:]),  # heads x dims one dense run
        (2, torch.zeros(100).as_strided((3, 1, 8), (10, 77, 1))),  # a size-1 dim in the run, any stride
    ],
    ids=["dense-1d", "one-element", "fused-rows", "dense-rows", "size-1-dim"],
)
def test_views_dense_where_the_kernel_takes_no_stride_are_accepted(dims, tensor):
    try:
        refuse_unread_strides("peer", dims, "ptr + i", x=tensor)
    except NotSupported as e:  # the gate's plugin would report it as a skip: fail it here
        pytest.fail(f"refused a view the kernel reads right: {e}")


@pytest.mark.parametrize(
    "dims,tensor,strides",
    [
        (1, torch.arange(6)[::2], "(2,)"),  # lengths sliced from a wider buffer
        (1, _every_other(torch.zeros(3, 4, 8)), "(64, 16, 2)"),  # last dim at stride 2
        (2, torch.zeros(4, 3, 8).transpose(0, 1), "(8, 24, 1)"),  # heads outermost: heads x dims not one run
        (2, torch.zeros(3, 4, 10)[..., :8], "(40, 10, 1)"),  # padded dims: the run has gaps
    ],
    ids=["strided-1d", "last-dim-stride-2", "heads-outermost", "padded-dims"],
)
def test_views_strided_where_the_kernel_takes_no_stride_are_refused_naming_them(dims, tensor, strides):
    with pytest.raises(NotSupported) as refused:
        refuse_unread_strides("peer", dims, "ptr + i", dense=torch.zeros(3), x=tensor)
    message = str(refused.value)
    assert f"peer: x with strides {strides}" in message and "ptr + i" in message, message


def _finding(title: str, families: tuple[str, ...]) -> Finding:
    return Finding(title, "bug", "peer 1.0", "summary", lambda: True, families=families)


def test_family_lines_name_each_familys_findings_or_none_found():
    findings = (
        _finding("a", ("test_decode.py",)),
        _finding("b", ("test_strided_layouts.py",)),
        _finding("c", ("test_strided_layouts.py", "test_decode.py")),
    )
    reviews = (FamilyReview("test_fp8_kv.py", "No peer declares it."), FamilyReview("test_strided_layouts.py"))
    lines = family_lines(findings, [True, False, None], reviews)
    assert lines == [
        "- `test_fp8_kv.py`: none found. No peer declares it.",
        "- `test_strided_layouts.py`: findings 2 (fixed), 3 (could not be re-checked).",
        "- `test_decode.py`: findings 1 (still reproduces), 3 (could not be re-checked).",
    ]


def test_family_lines_say_finding_for_one():
    lines = family_lines((_finding("a", ("test_x.py",)),), [False], ())
    assert lines == ["- `test_x.py`: finding 1 (fixed)."]


@pytest.mark.parametrize("op", ["paged_decode", "paged_prefill", "write_kv"])
def test_an_operation_an_fp8_adapter_lacks_is_not_supported_with_the_scales(op):
    """The fp8 family passes ``k_scale`` / ``v_scale`` to every operation; an adapter without one of them
    (vllm-unified has no write_kv) must say "not supported", not fail on the keywords."""
    from pagedbench.conformance.adapter import Implementation

    impl = Implementation()
    args = {"paged_decode": 5, "paged_prefill": 6, "write_kv": 5}[op]
    with pytest.raises(NotSupported, match=f"does not implement {op}"):
        getattr(impl, op)(*([None] * args), k_scale=0.5, v_scale=0.25)
