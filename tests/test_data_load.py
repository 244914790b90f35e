"""dist_eval.data.load: which loads build datasets' cache (one rank loads first) and which read a folder as it is."""
import datasets
from conftest import write_csv

from dist_eval.data.load import fills_cache, load_split


def test_loose_files_and_hub_names_fill_the_cache_a_saved_folder_does_not(tmp_path):
    csv = write_csv(str(tmp_path / "a.csv"), 5)
    folder = str(tmp_path / "saved")
    datasets.Dataset.from_dict({"text": ["a b", "c"], "label": [0, 1]}).save_to_disk(folder)
    assert fills_cache(csv) and fills_cache([csv]) and fills_cache([csv, csv])
    assert fills_cache("some_org/some_dataset")
    assert not fills_cache(folder) and not fills_cache([folder])
    # and the folder is read in place: loading it adds no file to it
    before = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert load_split(folder)["text"] == ["a b", "c"]
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == before
