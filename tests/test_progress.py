"""Training output modes: a tqdm bar with ETA and throughput on a terminal, plain lines otherwise,
nothing but JSON in --jsonl mode, and the log file always."""
import json

from vkdsl.train.progress import Reporter

REC = dict(tokens=10, seq_tokens=384, time=2.0, loss=1.25, tmkl=0.01, lr=1e-3, grad_norm=0.5)


def test_plain_lines_when_not_a_terminal(capsys, tmp_path):
    r = Reporter(tmp_path / "train.log", tty=False)
    r.progress(1, 3, REC)
    out = capsys.readouterr().out
    assert out.startswith("step 1/3  loss 1.2500") and "192 tok/s" in out and "ETA" in out
    assert (tmp_path / "train.log").read_text() == out


def test_bar_on_a_terminal(capsys):
    r = Reporter(None, tty=True)
    for s in (1, 2, 3):
        r.progress(s, 3, REC)
        if s == 2:
            r.say("a message above the bar")
    err_out = capsys.readouterr()
    text = err_out.out
    assert "3/3" in text and "loss 1.2500" in text and "192 tok/s" in text and "a message above the bar" in text
    assert r.bar is None                     # closed at the last step


def test_jsonl_mode_prints_only_json(capsys):
    r = Reporter(None, jsonl=True, tty=True)
    r.say("hidden")
    r.progress(1, 2, REC)
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rows == [{"event": "step", "step": 1, **REC}]
