"""Named API keys (app/keys.py): parsing, refusals at start, matching."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.keys import ApiKeys


def test_entries_and_file_merge_into_named_keys(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\n\nbob:k#3 \r\n  carol : k4\n")
    keys = ApiKeys.parse(["alice:k1", " k2\n"], keys_file)
    assert keys.names == ["alice", "default", "bob", "carol"]
    assert [keys.match(t) for t in (b"k1", b"k2", b"k#3", b"k4")] == keys.names
    assert keys.match(b"k") is None and keys.match(b"") is None


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ([""], "is empty"),
        (["alice:"], "is empty"),
        (["s\u00e9same"], "outside printable ASCII"),
        (["two words"], "outside printable ASCII"),
        (["bad name:k-zz"], "name must be"),
        (["a:k1-x", "a:k2-x"], "'a' is given twice"),
        (["a:k-dup", "b:k-dup"], "given twice"),
    ],
)
def test_a_bad_key_is_refused_without_showing_it(entries: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says) as refused:
        ApiKeys.parse(entries)
    secrets = [entry.partition(":")[2] if ":" in entry else entry for entry in entries]
    assert not any(secret and secret in str(refused.value) for secret in secrets)


def test_a_missing_or_empty_keys_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        ApiKeys.parse([], tmp_path / "absent")
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.parse([], tmp_path / "empty")


def test_a_key_is_never_in_its_repr() -> None:
    assert "k-secret" not in repr(ApiKeys.parse(["n:k-secret"]).keys)
