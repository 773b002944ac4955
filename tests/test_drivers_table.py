"""tests/drivers_table.py renders the README's tested-drivers table from a driver's log and doctor
report: each cell comes from the line that states it, and a step that failed says so."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import drivers_table  # noqa: E402

LOG = """* [0] SwiftShader Device (Subzero)
318/318 rows passed, 28 not applicable on this device (fp16); cold 11.83 s (compiles), warm 3.61 s
verify: exit 0 in 19 s
doctor: exit 0 in 80 s
train: exit 3 in 863 s
generate: exit 1 in 28 s
bundle: exit 0 in 40 s
"""
DOCTOR = {"rows": [
    {"section": "device", "item": "name", "value": "[2] SwiftShader Device (Subzero) (cpu; SwiftShader"
     " driver 5.0.0)", "why": "Vulkan 1.3.0"},
    {"section": "bench", "item": "matmul 512^3 fp32", "value": "0.9 GFLOP/s",
     "why": "numpy in the same process 270.0 GFLOP/s (ratio 0.00)"},
    {"section": "bench", "item": "SFT step 1x64, adapters on q,v", "value": "2 tokens/s",
     "why": "31.50 s per step (forward, backward, AdamW); numpy fp32 forward alone 171 tokens/s"}]}


def test_a_row_states_each_measure_and_each_failed_step(tmp_path):
    (tmp_path / "ss.log").write_text(LOG)
    (tmp_path / "ss.doctor.json").write_text(json.dumps(DOCTOR))
    cells = [c.strip() for c in drivers_table.row(tmp_path, "ss").split("|")[1:-1]]
    assert cells == ["ss", "SwiftShader Device (Subzero) (cpu; SwiftShader driver 5.0.0), Vulkan 1.3.0",
                     "318/318, 28 n/a", "11.8 s / 3.6 s", "0.9 GFLOP/s (0.0033x numpy's)",
                     "2 tokens/s, 31.50 s", "863 s", "28 s (exit 1)", "40 s, offline not run"]
    assert len(cells) == drivers_table.HEADER.splitlines()[0].count("|") - 1


def test_a_driver_with_no_log_is_a_row_that_says_so(tmp_path):
    assert drivers_table.row(tmp_path, "mesa25").startswith("| mesa25 | not run |")
