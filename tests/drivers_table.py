"""The README's tested-drivers table, from what tests/drivers.sh kept for each driver:
NAME.doctor.json (`vkdsl doctor --json`: the device, its driver version, the matmul and SFT-step
benchmarks) and NAME.log (verify's summary line with its cold and warm times, each step's exit
status and time).

    python tests/drivers_table.py LOGDIR NAME...      # prints one Markdown row per driver
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HEADER = ("| driver | device, driver (`vkdsl doctor`) | verify | cold / warm | matmul 512³ fp32 "
          "| SFT step (doctor) | short default job | generate | bundle job |\n"
          "|---|---|---|---|---|---|---|---|---|")
VERIFY = re.compile(r"^(\d+)/(\d+) rows passed(?:, (\d+) not applicable)?.*cold ([0-9.]+) s.*"
                    r"warm ([0-9.]+) s", re.M)
STEP = re.compile(r"^(\w+): exit (\d+) in (\d+) s$", re.M)


def _doctor(path: Path) -> dict[str, dict]:
    if not path.is_file():
        return {}
    return {r["item"].split(" 1x")[0]: r for r in json.loads(path.read_text())["rows"]}


def row(logdir: Path, name: str) -> str:
    log = logdir / f"{name}.log"
    if not log.is_file():
        return f"| {name} | not run | | | | | | | |"
    text = log.read_text(errors="replace")
    doc = _doctor(logdir / f"{name}.doctor.json")
    steps = {m[1]: (int(m[2]), int(m[3])) for m in STEP.finditer(text)}

    def took(step: str, ok=(0,)) -> str:
        if step not in steps:
            return "not run"
        rc, s = steps[step]
        return f"{s} s" + ("" if rc in ok else f" (exit {rc})")

    v = VERIFY.findall(text)
    if v:
        passed, total, na, cold, warm = v[-1]
        verify = f"{passed}/{total}" + (f", {na} n/a" if na else "")
        times = f"{float(cold):.1f} s / {float(warm):.1f} s"
    else:
        verify, times = f"no summary ({took('verify')})", ""
    dev = doc.get("name", {}).get("value", "no doctor report")
    dev = re.sub(r"^\[\d+\] ", "", dev)
    if "name" in doc:
        dev += f", {doc['name']['why']}"
    mm = doc.get("matmul 512^3 fp32")
    matmul = ""
    if mm:      # the ratio again, to more places than doctor prints (SwiftShader's is 0.005)
        rate, numpy = (float(re.search(r"([0-9.]+) GFLOP/s", t)[1])
                       for t in (mm["value"], mm["why"]))
        matmul = f"{mm['value']} ({rate / numpy:.2g}x numpy's)"
    sft = doc.get("SFT step", {})
    sft = f"{sft['value']}, {sft['why'].split(' per step')[0]}" if sft else ""
    # one step cannot pass every gate: exit 3 (gates) still means the job ran to its report
    return (f"| {name} | {dev} | {verify} | {times} | {matmul} | {sft} | "
            f"{took('train', ok=(0, 3))} | {took('generate')} | "
            f"{took('bundle')}, offline {took('offline')} |")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print(HEADER)
    for name in argv[1:]:
        print(row(Path(argv[0]), name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
