"""bench_decode's floor: the bytes a decode step must read over the device's peak HBM bandwidth, per
batch size, in the JSON (documented in docs/tools.md) and the summary's table; the CPU's dry run
writes the bytes and says why it has no floor."""

import json
import re

import pytest

from megafuse.model import preset
from megafuse.model.stats import decode_read_bytes
from megafuse.tools.bench_common import HBM_PEAK_BYTES_PER_S, peak_hbm_bytes_per_s
from megafuse.tools.bench_decode import decode_floor, main, summary_table
from tests.passes.tiny import every_role_tiny
from tests.tools.schemas import documented_schema

SCHEMA = "megafuse.bench_decode/4"


def test_the_peak_bandwidth_is_looked_up_by_device_name_and_an_unknown_device_is_named():
    assert peak_hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12  # the H100 SXM's name in torch
    assert peak_hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    with pytest.raises(ValueError) as e:
        peak_hbm_bytes_per_s("NVIDIA A100-SXM4-80GB")
    assert "no peak HBM bandwidth is known for device 'NVIDIA A100-SXM4-80GB'" in str(e.value)
    assert all(name in str(e.value) for name in HBM_PEAK_BYTES_PER_S) and "HBM_PEAK_BYTES_PER_S" in str(e.value)


def test_the_floor_is_the_bytes_of_each_batch_over_the_peak_bandwidth():
    cfg = preset("tiny")
    floor = decode_floor(cfg, (1, 32), 40, "NVIDIA H200")
    assert floor["hbm_peak_bytes_per_s"] == 4.8e12 and floor["note"] is None
    for B in (1, 32):
        reads = decode_read_bytes(cfg, B, 40)
        assert floor["by_batch"][B] == reads.to_dict() | {"floor_s": reads.total / 4.8e12}
    unknown = decode_floor(cfg, (1,), 40, "NVIDIA A100-SXM4-80GB")
    assert unknown["by_batch"][1]["floor_s"] is None and "A100" in unknown["note"]
    rows = {1: {"graphs_speedup": 2.0, "passes_speedup": None, "floor_s": floor["by_batch"][1]["floor_s"],
                "x_of_floor": 3.5}}
    table = summary_table(rows, floor).splitlines()
    assert "x of floor" in table[0] and "3.50x" in table[1] and "2.00x" in table[1] and table[1].rstrip().endswith("-")


@pytest.mark.slow
def test_the_dry_run_writes_the_floor_fields_and_documents_them(tmp_path, capsys):
    cfg_path = tmp_path / "tiny5.json"
    cfg_path.write_text(json.dumps(every_role_tiny().to_dict()))
    out = tmp_path / "decode.json"
    # one pass: every step runs its kernel in the interpreter, and the fields are the same for any pass set
    assert main(["--config", str(cfg_path), "--batches", "1", "--context", "12", "--repeat", "1", "--profiled", "1",
                 "--passes", "mega_gate", "--dry-run", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["schema"] == SCHEMA
    doc = documented_schema(SCHEMA)
    for key in [*r, *r["floor"], *r["floor"]["by_batch"]["1"], *r["passes-1"], *r["summary"]["1"]]:
        assert re.sub(r"-1$", "-<B>", key) in doc, key  # a stage of batch size 1 is documented as name-<B>
    floor = r["floor"]["by_batch"]["1"]
    assert floor == decode_read_bytes(every_role_tiny(), 1, 12).to_dict() | {"floor_s": None}
    assert r["floor"]["hbm_peak_bytes_per_s"] is None and "dry run on the CPU" in r["floor"]["note"]
    assert r["passes-1"]["x_of_floor"] == {"no_graphs": None, "graphs": None}
    assert r["summary"]["1"]["x_of_floor"] is None
    assert "x of floor" in capsys.readouterr().err
