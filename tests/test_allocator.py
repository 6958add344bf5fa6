"""The allocator setting of the CPU stages (isoexec/allocator.py): tcmalloc first in LD_PRELOAD when installed."""

from isoexec import allocator


def test_with_tcmalloc_prepends_an_installed_library_once(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    cands = (str(tmp_path / "missing.so"), str(lib))
    assert allocator.tcmalloc_path(cands) == str(lib)
    env = allocator.with_tcmalloc({"LD_PRELOAD": "/x/libgomp.so"}, cands)
    assert env["LD_PRELOAD"] == f"{lib}:/x/libgomp.so"
    assert allocator.with_tcmalloc(env, cands) == env  # already there
    assert allocator.with_tcmalloc({}, cands) == {"LD_PRELOAD": str(lib)}


def test_without_tcmalloc_the_environment_is_unchanged(tmp_path):
    assert allocator.tcmalloc_path((str(tmp_path / "no.so"),)) is None
    assert allocator.with_tcmalloc({"A": "1"}, (str(tmp_path / "no.so"),)) == {"A": "1"}


def test_allocator_names_the_preloaded_tcmalloc(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/x/libgomp.so:/usr/lib/libtcmalloc_minimal.so.4")
    assert allocator.allocator() == "/usr/lib/libtcmalloc_minimal.so.4"
    monkeypatch.delenv("LD_PRELOAD")
    assert allocator.allocator() == "glibc"
