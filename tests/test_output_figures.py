"""The reliability diagram: a valid PNG of the reliability table of (probs, labels); None without
matplotlib; bad input rejected by the table."""
import struct
import sys
import zlib

import numpy as np
import pytest

from dist_eval.metrics import expected_calibration_error, reliability_table, softmax
from dist_eval.output.figures import reliability_table_png

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def reliability_diagram_png(probs, labels, title: str = ""):
    """The diagram as the report draws it: of the table metrics.json holds (15 bins) and its ECE."""
    table = reliability_table(probs, labels, 15)  # validates the input before any import
    ece = expected_calibration_error(probs, labels, 15) if int(table["count"].sum()) else float("nan")
    return reliability_table_png(table, ece, title)


def png_size(data):
    """Width and height from a PNG's IHDR chunk, after checking the magic and the CRC."""
    assert data[:8] == PNG_MAGIC
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("n,k", [(500, 4), (60, 2), (0, 3)])
def test_reliability_diagram_writes_a_valid_png(tmp_path, n, k):
    rng = np.random.default_rng(n)
    probs = softmax(rng.normal(size=(n, k)) * 2)
    labels = rng.integers(0, k, n)
    target = tmp_path / "reliability.png"
    data = reliability_diagram_png(probs, labels, title="run A")
    target.write_bytes(data)
    width, height = png_size(data)
    assert width > 300 and height > 300
    image = pytest.importorskip("matplotlib.image").imread(target)  # decodes
    assert image.shape[:2] == (height, width)


def test_reliability_diagram_without_matplotlib_and_bad_input(monkeypatch):
    with pytest.raises(ValueError):
        reliability_diagram_png(np.full((3, 2), 0.5), [0, 1, 2])
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert reliability_diagram_png(np.full((3, 2), 0.5), [0, 1, 1]) is None
