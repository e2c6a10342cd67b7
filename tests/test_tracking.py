"""Tracker: JSONL file per step and a console table with a single header."""

import io
import json

from hybridflow.utils.tracking import CONSOLE_COLUMNS, Tracker


def test_jsonl_one_line_per_log(tmp_path):
    log_dir = tmp_path / "logs"
    t = Tracker(["jsonl"], str(log_dir), stream=io.StringIO())
    t.log({"critic/score/mean": 0.5, "actor/pg_loss": -0.1}, step=1)
    t.log({"val-core/x/acc/mean@1": 0.25}, step=2)
    t.close()
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "critic/score/mean": 0.5, "actor/pg_loss": -0.1},
        {"step": 2, "val-core/x/acc/mean@1": 0.25},
    ]
    # appends on re-open (resume)
    t2 = Tracker(["jsonl"], str(log_dir), stream=io.StringIO())
    t2.log({"a": 1.0}, step=3)
    t2.close()
    assert json.loads((log_dir / "metrics.jsonl").read_text().splitlines()[-1]) == {"step": 3, "a": 1.0}


def test_no_console_without_console_logger(tmp_path):
    out = io.StringIO()
    t = Tracker(["jsonl"], str(tmp_path), stream=out)
    t.log({"critic/score/mean": 1.0}, step=1)
    t.close()
    assert out.getvalue() == ""


def test_no_file_without_jsonl_logger(tmp_path):
    out = io.StringIO()
    t = Tracker(["console"], str(tmp_path), stream=out)
    t.log({"critic/score/mean": 1.0}, step=1)
    t.close()
    assert list(tmp_path.iterdir()) == []
    assert len(out.getvalue().splitlines()) == 2


def test_console_table():
    out = io.StringIO()
    t = Tracker(["console"], None, stream=out)
    t.log({"critic/score/mean": 0.5, "actor/pg_loss": 0.0123, "timing_s/step": 1.5}, step=1)
    t.log({"critic/score/mean": 0.75, "val-core/digit_max/acc/mean@1": 0.625, "actor/ppo_kl": 0.001}, step=2)
    t.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # header once + one row per step
    header = [c.strip() for c in lines[0].split("|")]
    assert header == [h for h, _, _ in CONSOLE_COLUMNS]
    assert header[:3] == ["step", "score", "val_acc"]
    rows = [dict(zip(header, (c.strip() for c in line.split("|")))) for line in lines[1:]]
    assert rows[0] == {
        "step": "1", "score": "0.500", "val_acc": "-", "pg_loss": "0.0123", "ppo_kl": "-",
        "entropy": "-", "grad": "-", "vf_loss": "-", "resp_len": "-", "step_s": "1.50",
    }
    assert rows[1]["step"] == "2" and rows[1]["score"] == "0.750"
    assert rows[1]["val_acc"] == "0.625"  # any val-core/... key fills the column
    assert rows[1]["ppo_kl"] == "1.00e-03" and rows[1]["pg_loss"] == "-"
    # the columns line up: every line has the same width
    assert len({len(line) for line in lines}) == 1


def test_tensorboard_events_hold_the_step_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracker(["tensorboard"], str(tmp_path), stream=io.StringIO())
    t.log({"critic/score/mean": 0.5, "timing_s/reshard": 0.01}, step=1)
    t.log({"critic/score/mean": 0.75}, step=2)
    t.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.5), (2, 0.75)]
    assert [e.step for e in events.Scalars("timing_s/reshard")] == [1]


def test_wandb_offline_run_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracker(["wandb"], str(tmp_path), stream=io.StringIO(), project="p", run_name="r", config={"a": 1})
    t.log({"critic/score/mean": 0.5}, step=1)
    t.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_prometheus_exporter_serves_latest_step_metrics(tmp_path):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from hybridflow.utils.prometheus import MetricsExporter

    exporter = MetricsExporter(0)
    t = Tracker([], None, stream=io.StringIO(), prometheus=exporter)
    t.log({"timing_s/reshard": 0.5, "reshard/bytes_per_rank": 1024.0}, step=1)
    t.log({"timing_s/reshard": 0.25}, step=2)
    text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5).read().decode()
    t.close()
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert values == {"hybridflow_step": 2.0, "hybridflow_timing_s_reshard": 0.25, "hybridflow_reshard_bytes_per_rank": 1024.0}
