"""The on-disk cache of coverage examples: the same examples as the search, reused, and
searched again whenever it cannot be trusted."""

import dataclasses
import json

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from attncheck import bugclasses, cache_root, coverage, specs
from tests.selftest import toy_spec


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setenv(cache_root.CACHE_ENV, str(tmp_path))
    coverage._examples.cache_clear()
    yield toy_spec.SPEC
    coverage._examples.cache_clear()


def ids(cases):
    return [c.id for c in cases]


def cached_files(tmp_path):
    return sorted((tmp_path / "coverage").glob("*.json"))


def fresh_examples(spec):
    coverage._examples.cache_clear()
    return coverage.examples(spec)


def test_cached_examples_are_the_searched_ones_and_are_reused(toy, tmp_path, monkeypatch):
    searched = coverage.search(toy)
    assert ids(fresh_examples(toy)) == ids(searched)
    assert len(cached_files(tmp_path)) == 1

    def no_search(spec):
        raise AssertionError("searched again although the cache was valid")

    monkeypatch.setattr(coverage, "search", no_search)
    assert ids(fresh_examples(toy)) == ids(searched)


@pytest.mark.parametrize("content", [
    "{not json",
    "[]",  # the format of an older attncheck
    json.dumps({"cases": [], "without_example": []}),  # covers no class
    json.dumps({"cases": [{"family": "another_family", "params": {}, "seed": 0}], "without_example": []}),
    json.dumps({"cases": [{"family": toy_spec.FAMILY, "params": {}, "seed": 0}],  # a stale parameter set
                "without_example": []}),
])
def test_an_unreadable_or_insufficient_cache_is_searched_again_and_rewritten(toy, tmp_path, content):
    searched = ids(fresh_examples(toy))
    [path] = cached_files(tmp_path)
    path.write_text(content)
    assert ids(fresh_examples(toy)) == searched
    assert [c["family"] for c in json.loads(path.read_text())["cases"]] == [toy_spec.FAMILY] * len(searched)


def test_a_class_no_case_can_exercise_is_a_named_hole_not_a_crash(toy, tmp_path, monkeypatch):
    """A class the strategy cannot draw under the active profile (the nightly's shapes left
    one flash class without any example, and the search's NoSuchExample ended the run's
    collection): the others keep their examples, and the coverage table names the hole."""
    never = bugclasses.BugClass("never_drawn", lambda p: False)
    monkeypatch.setattr(type(toy), "bug_classes", (*toy.bug_classes, never))
    found = fresh_examples(toy)
    assert found and not any(never.applies(c.params) for c in found)
    assert {n for c in found for n in toy.classes(c)} == set(toy.class_names) - {"never_drawn"}
    assert json.loads(cached_files(tmp_path)[0].read_text())["without_example"] == ["never_drawn"]
    assert ids(fresh_examples(toy)) == ids(found)  # the hole is remembered, not searched for again


def test_a_class_the_draws_miss_takes_its_explicit_example(toy, monkeypatch):
    """A class the strategy rarely draws is not a hole when the spec writes its example
    out; an example that does not exercise its class, or names no class, is a spec error."""
    rare = bugclasses.BugClass("rare", lambda p: p.seq_len == 1000)
    example = toy_spec.Case(toy_spec.FAMILY, dataclasses.replace(
        coverage.search(toy)[0].params, seq_len=1000), 7)
    monkeypatch.setattr(type(toy), "bug_classes", (*toy.bug_classes, rare))
    monkeypatch.setattr(type(toy), "explicit_examples", {"rare": example})
    found = fresh_examples(toy)
    assert example in found and {n for c in found for n in toy.classes(c)} == set(toy.class_names)
    monkeypatch.setattr(type(toy), "explicit_examples", {"rare": dataclasses.replace(
        example, params=dataclasses.replace(example.params, seq_len=8))})
    with pytest.raises(ValueError, match=r"explicit_examples\['rare'\] does not exercise its class"):
        coverage.search(toy)
    monkeypatch.setattr(type(toy), "explicit_examples", {"rarely": example})
    with pytest.raises(ValueError, match=r"name no bug class of the family: \['rarely'\]"):
        coverage.search(toy)


def test_every_built_in_explicit_example_exercises_its_class():
    for spec in specs.all_specs().values():
        for name, case in spec.explicit_examples.items():
            assert case.family == spec.name and name in spec.classes(case), (spec.name, name)


def test_the_key_changes_with_what_the_search_reads(toy, monkeypatch):
    import hypothesis

    key = coverage.search_key(toy)
    assert coverage.search_key(toy) == key
    with monkeypatch.context() as patch:
        patch.setattr(hypothesis, "__version__", hypothesis.__version__ + ".post1")
        assert coverage.search_key(toy) != key
    with monkeypatch.context() as patch:
        patch.setattr(type(toy), "bug_classes", toy.bug_classes[:1])
        assert coverage.search_key(toy) != key


def test_none_turns_the_cache_off(toy, tmp_path, monkeypatch):
    monkeypatch.setenv(cache_root.CACHE_ENV, cache_root.DISABLED)
    assert coverage.cache_dir() is None
    assert ids(fresh_examples(toy)) == ids(coverage.search(toy))
    assert not cached_files(tmp_path)


@settings(max_examples=10, deadline=None)
@given(data=st.data(), family=st.sampled_from(sorted(specs.all_specs())))
def test_a_case_survives_the_cache_file_with_its_id(data, family):
    spec = specs.all_specs()[family]
    case = data.draw(spec.cases())
    assert spec.case_from_json(json.loads(json.dumps(case.to_json()))) == case


@pytest.fixture
def ci_shapes():
    """The CI profile's static shapes, which the shipped examples are searched under."""
    previous = settings.get_current_profile_name()
    settings.load_profile("ci")
    yield
    settings.load_profile(previous)


@pytest.mark.parametrize("family", sorted(specs.all_specs()))
def test_the_package_ships_each_builtin_familys_examples_as_a_fresh_search_finds_them(family, ci_shapes):
    """A clone or a wheel gates without a search: the package ships the examples of the
    current source; one searched for another source has another key and is never read."""
    spec = specs.all_specs()[family]
    path = coverage.shipped_path(spec)
    shipped = [p.name for p in coverage.SHIPPED.glob(f"{family}-*.json")]
    assert shipped == [path.name], f"{shipped}: run `attncheck coverage update` and commit its files"
    searched = json.loads(json.dumps([c.to_json() for c in coverage.search(spec)]))
    assert json.loads(path.read_text())["cases"] == searched, (
        f"{path.name} is not what a fresh search finds: run `attncheck coverage update`")


def test_a_shipped_file_is_read_before_the_cache_and_searches_nothing(monkeypatch, tmp_path, ci_shapes):
    spec = specs.all_specs()["blockwise_ffn"]
    monkeypatch.setenv(cache_root.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(coverage, "search", lambda spec: pytest.fail("searched despite the shipped examples"))
    assert ids(fresh_examples(spec)) == [spec.case_from_json(c).id for c in json.loads(
        coverage.shipped_path(spec).read_text())["cases"]]
    assert not cached_files(tmp_path)
    coverage._examples.cache_clear()


def test_a_pair_with_a_cell_of_the_data_is_covered_on_a_program_already_found(ci_shapes):
    """The pair classes' cases are drawn from the found examples' programs with other data
    as well as from the strategy, and a new program costs more: a value distribution
    paired with a dtype compiles nothing the examples of each dtype did not."""
    spec = specs.all_specs()["flash_attention"]
    pairs = [c for c in spec.bug_classes if c.pair and c.name.startswith("values_")]
    ci = settings(settings.get_profile("ci"), database=None)
    found = [find(spec.cases(), lambda c, d=dtype: c.params.dtype == d and c.params.values == "normal", settings=ci)
             for dtype in ("float32", "bfloat16")]
    chosen = coverage._covering(spec, pairs, lambda cls, p: cls.applies(p), found)
    assert [c.name for c in pairs if not any(c.applies(case.params) for case in chosen)] == []
    assert {spec.program(c.params) for c in chosen} <= {spec.program(c.params) for c in found}
