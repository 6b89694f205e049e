"""The order `make test` hands out test files in (tests/conftest.py): longest first."""

from pathlib import Path

from tests.conftest import file_order, heavy_files


def test_heavy_files_go_first_then_the_others_by_their_number_of_tests() -> None:
    files = ["a.py", "b.py", "b.py", "c.py", "d.py", "d.py", "d.py", "e.py"]
    order = file_order(files, heavy=["e.py", "c.py", "gone.py"])
    assert order == ["e.py", "c.py", "d.py", "b.py", "a.py"]


def test_every_heavy_file_is_a_test_file_of_the_suite() -> None:
    """A renamed or removed file would silently lose its place at the front."""
    root = Path(__file__).parents[1]
    listed = heavy_files()
    assert listed and all((root / name).is_file() for name in listed), listed
