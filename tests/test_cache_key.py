"""The generated ops' schemas in torch.compile's on-disk cache keys
(dynamo/cache_key.py): a graph cached against one schema of an op must not
be replayed against another."""

import pytest
import torch

import transformer_engine_compile  # noqa: F401  (defines the ops)
from transformer_engine_compile.compat import compile_cache_config
from transformer_engine_compile.dynamo import cache_key

pytestmark = pytest.mark.skipif(compile_cache_config() is None,
                                reason="this torch has no torch.compiler.config.cache_key_tag")


@pytest.fixture
def restore():
    config = compile_cache_config()
    tag, schemas = config.cache_key_tag, dict(cache_key._SCHEMAS)
    yield config
    config.cache_key_tag = tag
    cache_key._SCHEMAS.clear()
    cache_key._SCHEMAS.update(schemas)


def test_the_defined_ops_are_in_the_tag(restore):
    config = restore
    assert cache_key.MARK in config.cache_key_tag
    assert any(name.startswith("grouped_linear_bwd") for name in cache_key._SCHEMAS)


def test_a_changed_schema_changes_the_tag_and_the_users_tag_stays(restore):
    config = restore
    config.cache_key_tag = "mine"
    cache_key.note_schema("probe_op(Tensor x) -> Tensor")
    first = config.cache_key_tag
    assert first.startswith("mine" + cache_key.MARK)
    cache_key.note_schema("probe_op(Tensor x, Tensor? y) -> Tensor")  # the op regenerated
    second = config.cache_key_tag
    assert second.startswith("mine" + cache_key.MARK) and second != first
    cache_key.note_schema("probe_op(Tensor x) -> Tensor")  # back: the same key again
    assert config.cache_key_tag == first


def test_the_digest_ignores_definition_order(restore):
    config = restore
    cache_key._SCHEMAS.clear()
    cache_key.note_schema("a_op(Tensor x) -> Tensor")
    cache_key.note_schema("b_op(Tensor x) -> Tensor")
    one = config.cache_key_tag
    cache_key._SCHEMAS.clear()
    cache_key.note_schema("b_op(Tensor x) -> Tensor")
    cache_key.note_schema("a_op(Tensor x) -> Tensor")
    assert config.cache_key_tag == one


def test_a_changed_source_changes_the_tag(restore, monkeypatch):
    """A fake's layout lives in the code, not the schema: another version of
    the package's source misses the cache too."""
    config = restore
    cache_key.note_schema("probe_op(Tensor x) -> Tensor")
    first = config.cache_key_tag
    monkeypatch.setattr(cache_key, "_source_digest", lambda: "another version")
    cache_key.note_schema("probe_op(Tensor x) -> Tensor")
    assert config.cache_key_tag != first


def test_the_source_digest_reads_the_package():
    digest = cache_key._source_digest.__wrapped__()
    assert len(digest) == 64 and digest == cache_key._source_digest()
