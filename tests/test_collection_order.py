"""tests/conftest.py orders the collection: the files holding a ``slow`` or ``distributed`` test
come first, each file's tests together and in their order (so under ``-n 2 --dist loadgroup`` a long
test collected late does not run alone at the end)."""

from __future__ import annotations

pytest_plugins = ["pytester"]


def test_files_with_long_tests_are_collected_first_and_kept_together(pytester):
    pytester.makeconftest(
        """
        from tests.conftest import _long_modules_first

        def pytest_collection_modifyitems(items):
            _long_modules_first(items)
        """
    )
    quick = "def test_a():\n    pass\n\ndef test_b():\n    pass\n"
    pytester.makepyfile(
        test_1_quick=quick,
        test_2_mixed="import pytest\n\ndef test_c():\n    pass\n\n@pytest.mark.slow\ndef test_d():\n    pass\n",
        test_3_quick=quick,
        test_4_spawns="import pytest\n\n@pytest.mark.distributed\ndef test_e():\n    pass\n",
    )
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:xdist")
    collected = [line for line in result.outlines if "::" in line]
    assert collected == [
        "test_2_mixed.py::test_c",
        "test_2_mixed.py::test_d",
        "test_4_spawns.py::test_e",
        "test_1_quick.py::test_a",
        "test_1_quick.py::test_b",
        "test_3_quick.py::test_a",
        "test_3_quick.py::test_b",
    ], result.outlines
