"""An implementation's declared domain (attncheck.domain): the draws fitted to its sequence
multiple keep what the classes read of the shape, a case outside it is recorded as
unsupported by the implementation (never run, never a pass), and a declaration the family
cannot honour stops the run at startup."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from attncheck import check, coverage, domain, selection
from attncheck.backends import BACKENDS
from attncheck.specs.dpa.spec import SPEC as DPA


@domain.declare(sequence_multiple=128, supports=lambda p: p.bias == "none", description="no bias")
def tiled_attention(query, key, value, bias=None, mask=None, **kwargs):
    return jax.nn.dot_product_attention(query, key, value, bias, mask, **kwargs)


TILED = f"{__name__}:tiled_attention"


@pytest.mark.parametrize("fields, message", [
    (dict(sequence_multiple=0), "sequence_multiple must be a positive int, got 0"),
    (dict(sequence_multiple=True), "sequence_multiple must be a positive int, got True"),
    (dict(supports=3, description="x"), "supports must be a predicate over a case's params, got int"),
    (dict(supports=lambda p: True), "a supports predicate needs a description"),
])
def test_a_domain_names_what_is_wrong_with_it(fields, message):
    with pytest.raises((TypeError, ValueError), match=message):
        domain.Domain(**fields)


def test_an_implementation_without_a_declaration_takes_every_case():
    assert domain.of(jax.nn.dot_product_attention) == domain.FULL
    not_a_domain = lambda *a: None  # noqa: E731
    not_a_domain.attncheck_domain = {"sequence_multiple": 128}
    with pytest.raises(TypeError, match="must be an attncheck.domain.Domain, got dict"):
        domain.of(not_a_domain)


@pytest.mark.parametrize("t, s, fitted", [(8, 128, (128, 256)), (128, 128, (128, 128)), (200, 100, (256, 128)),
                                          (100, 120, (128, 256)), (120, 100, (256, 128)), (1, 4096, (128, 4096)),
                                          (130, 7, (256, 128))])
def test_fitted_sequences_are_multiples_and_keep_t_below_equal_or_above_s(t, s, fitted):
    params = dataclasses.replace(coverage.examples(DPA)[0].params, q_len=t, kv_len=s, q_lengths=None,
                                 kv_lengths=None)
    got = DPA.fit_sequences(params, 128)
    assert (got.q_len, got.kv_len) == fitted


def test_a_case_outside_the_domain_is_one_unsupported_record_and_fitted_cases_are_judged():
    target = check.Target(DPA, "user", tiled_attention, BACKENDS["xla"], ref=TILED)
    examples = coverage.examples(DPA)
    unfitted = next(c for c in examples if c.params.q_len % 128)
    [record] = check.check_case(target, unfitted).records
    assert (record.outcome, record.direction, record.expected) == ("error", "all", domain.DECLARED)
    assert record.reason == (f"{check.UNSUPPORTED_BY_IMPLEMENTATION}its sequence lengths are multiples of 128; "
                             "this case's are not")
    with_bias = target.fit(next(c for c in examples if c.params.bias != "none"))
    [record] = check.check_case(target, with_bias).records
    assert record.reason == f"{check.UNSUPPORTED_BY_IMPLEMENTATION}outside its declared domain (no bias)"
    plain = target.fit(next(c for c in examples if c.params.bias == "none" and c.params.q_lengths is None))
    assert target.refusal(plain) is None
    records = check.check_case(target, plain).records
    assert records and all(r.outcome == "pass" for r in records), [r.reason for r in records]


def test_a_sequence_multiple_for_a_family_that_cannot_fit_its_draws_stops_the_run():
    with pytest.raises(selection.SelectionError, match="family 'flash_attention' cannot fit its draws"):
        selection.Options(impls=(f"flash_attention={TILED}",)).impl_overrides()
    assert selection.Options(impls=(f"dot_product_attention={TILED}",)).impl_overrides() == {
        "dot_product_attention": TILED}


@domain.declare(takes={"dtype": "float32"})
def float32_attention(query, key, value, bias=None, mask=None, **kwargs):
    return jax.nn.dot_product_attention(query, key, value, bias, mask, **kwargs)


def test_a_parameter_the_implementation_takes_one_value_of_is_set_in_its_draws():
    target = check.Target(DPA, "user", float32_attention, BACKENDS["xla"], ref=f"{__name__}:float32_attention")
    bf16 = next(c for c in coverage.examples(DPA) if c.params.dtype == "bfloat16")
    fitted = target.fit(bf16)
    assert fitted.params == dataclasses.replace(bf16.params, dtype="float32") and fitted.seed == bf16.seed
    assert target.refusal(fitted) is None
    [record] = check.check_case(target, bf16).records
    assert record.reason == (f"{check.UNSUPPORTED_BY_IMPLEMENTATION}it takes dtype='float32' alone; this case has "
                             "'bfloat16'")


def test_a_parameter_the_family_does_not_have_stops_the_run():
    misspelt = domain.declare(takes={"d_type": "float32"})(lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"takes names \['d_type'\], which are not parameters of DPAParams"):
        domain.check_takes(domain.of(misspelt), DPA.params_type)
    with pytest.raises(TypeError, match="takes must map parameter names"):
        domain.Domain(takes=["dtype"])
