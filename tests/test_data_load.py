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


def test_a_csv_reads_na_texts_as_texts_and_only_empty_cells_as_missing(tmp_path):
    """Issue 50. Before: pandas' defaults read the texts "NA", "null", "n/a", "None" as missing values
    (a row whose text is "NA" was refused as having none). An empty cell is still missing: an empty
    text or label is refused as before (tests/test_cli_bad_input.py)."""
    for name, sep in (("a.csv", ","), ("a.tsv", "\t")):
        path = tmp_path / name
        path.write_text("\n".join(sep.join(row) for row in (
            ("text", "label", "region"), ("NA", "0", "null"), ("", "1", ""), ("n/a", "", "NA"), ("None", "2", "nan"))))
        data = load_split(str(path))
        assert data["text"] == ["NA", None, "n/a", "None"]
        assert data["label"] == [0, 1, None, 2]
        assert data["region"] == ["null", None, "NA", "nan"]
