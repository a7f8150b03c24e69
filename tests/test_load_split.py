"""An engine's start split by its log (serving.load_split): the lines vLLM 0.32 writes, no engine."""

from __future__ import annotations

import datetime as dt

from pipeline.stages import serving

LOG = """\
HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu python vllm_cli.py serve /models/tiny --port 8100
(APIServer pid=7883) INFO 12-05 20:35:41 [api_utils.py:286] non-default args: {'model_tag': '/models/tiny'}
(Worker pid=7905) INFO 12-05 20:35:54 [cpu_model_runner.py:68] Starting to load model /models/tiny...
(Worker pid=7905) INFO 12-05 20:35:54 [base_loader.py:82] Initializing model took 0.092465 seconds
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 59.02it/s]
(Worker pid=7905) INFO 12-05 20:35:54 [default_loader.py:501] Loading weights took 0.02 seconds
(Worker pid=7905) INFO 12-05 20:35:55 [cpu_model_runner.py:87] Warming up model for the compilation...
(EngineCore pid=7895) INFO 12-05 20:36:00 [core.py:402] init engine (profile, create kv cache, warmup model) took 5.01 s
"""


def test_a_start_is_split_into_load_start_weights_and_engine_init(tmp_path):
    log = tmp_path / "engine-0.log"
    log.write_text(LOG)
    started = dt.datetime(2026, 12, 5, 20, 35, 33, 400000).timestamp()  # local time, as vLLM stamps
    assert serving.load_split(log, started) == {"start_to_load_s": 21.0, "weights_s": 0.02, "init_engine_s": 5.01}


def test_missing_lines_and_a_missing_log_give_none(tmp_path):
    log = tmp_path / "engine-0.log"
    log.write_text(LOG.splitlines()[0] + "\n")
    empty = {"start_to_load_s": None, "weights_s": None, "init_engine_s": None}
    assert serving.load_split(log, 0.0) == empty
    assert serving.load_split(tmp_path / "absent.log", 0.0) == empty
