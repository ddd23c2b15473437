"""Consistency at the job's own scale (issue 44): `prepare --mode consistency` with no size flag
on the jobs people run, with real models' config.json shapes found from the hub id in a Hugging
Face cache (tests/data/hf_hub), on vLLM, SGLang and vLLM-Ascend rollouts: the plan is written,
its records fit 5 GiB per dumped step covering the whole response, the user's batch and
parallelism stay, the run is bounded, and `check` agrees with the derived script."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from rl_msprobe.dumps.position_size import RecordModel, records, tensors_per_token
from rl_msprobe.launch.overrides import Overrides
from rl_msprobe.launch.script import parse_script
from rl_msprobe.planner import model_config
from tests.planner.conftest import CORPUS

HUB = Path(__file__).resolve().parents[1] / "data" / "hf_hub"
TREE = "release:verl==0.9.1"
R = "actor_rollout_ref.rollout."
# script -> (rollout TP, train batch, n, max_num_seqs)
JOBS = {
    "run_scale_qwen2_7b_8gpu.sh": (2, 1024, 5, 1024),
    "run_scale_qwen2_7b_16gpu.sh": (2, 256, 8, 256),
    "run_scale_qwen2_5_32b_16gpu.sh": (4, 512, 8, 512),
    "run_scale_qwen3_30b_a3b_16gpu.sh": (4, 256, 16, 256),
}
ROLLOUTS = ("vllm", "sglang", "vllm-ascend")
KEPT = (
    R + "tensor_model_parallel_size",
    "data.train_batch_size",
    R + "n",
    R + "max_num_seqs",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "trainer.balance_batch",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
)


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def variant(name: str, rollout: str) -> str:
    text = (CORPUS / name).read_text()
    if rollout == "sglang":
        return text.replace(f"{R}name=vllm", f"{R}name=sglang")
    if rollout == "vllm-ascend":
        return text.replace(f"{R}name=vllm \\", f"{R}name=vllm \\\n    trainer.device=npu \\")
    return text


def overrides(text: str) -> Overrides:
    script = parse_script(text)
    assert script.command is not None
    return Overrides(script.command.args)


def value(ov: Overrides, key: str) -> object:
    found = ov.get(key)
    return None if found is None else found.value


def gib_per_step(notes: list[str]) -> float:
    (note,) = [n for n in notes if n.startswith("Records: estimated records per dumped step:")]
    found = re.search(r"per dumped step: ([0-9.e+-]+) GiB", note)
    assert found, note
    return float(found.group(1))


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(HUB))
    return HUB


@pytest.mark.release
@pytest.mark.parametrize("rollout", ROLLOUTS)
@pytest.mark.parametrize("name", sorted(JOBS))
def test_prepare_keeps_the_job_and_fits(name: str, rollout: str, hub: Path, tmp_path: Path) -> None:
    script = tmp_path / name
    text = variant(name, rollout)
    script.write_text(text)
    code, out, err = cli(
        "prepare",
        str(script),
        "--mode",
        "consistency",
        "--tree",
        TREE,
        "--out",
        str(tmp_path / "out"),
        "--json",
    )
    doc = json.loads(out)
    assert code == 0, (doc["violations"], err)
    gib = gib_per_step(doc["notes"])
    assert 0 < gib <= 5.0, doc["notes"]
    print(f"{name} {rollout}: {gib} GiB per dumped step")  # the numbers issue 44 asks for (-s shows them)
    note = next(n for n in doc["notes"] if n.startswith("Records: estimated"))
    assert "every position of the whole response" in note and "for the run (1 dumped step(s))" in note
    derived_text = Path(doc["script"]).read_text()
    before, after = overrides(text), overrides(derived_text)
    for key in KEPT:
        assert value(after, key) == value(before, key), key
    tp, batch, n, seqs = JOBS[name]
    assert (value(after, R + "tensor_model_parallel_size"), value(after, "data.train_batch_size")) == (
        tp,
        batch,
    )
    assert (value(after, R + "n"), value(after, R + "max_num_seqs")) == (n, seqs)
    # a bounded run
    assert value(after, "trainer.total_training_steps") == 1
    assert value(after, "trainer.test_freq") == -1 and value(after, "trainer.save_freq") == -1
    assert value(after, "trainer.val_before_train") is False
    env = {e["rule"] for e in doc["changes"]}
    assert {"consistency.env.RL_MSPROBE_RECORD_DIR", "consistency.env.RL_MSPROBE_RECORD_SHARE"} <= env
    assert "# rl-msprobe consistency plan:" in derived_text
    code, out, err = cli("check", doc["script"], "--mode", "consistency", "--tree", TREE)
    assert code == 0, out


def test_tensor_table_counts_moe_and_qk_norm() -> None:
    dense = RecordModel(layers=28, heads=28, kv_heads=4, hidden=3584)
    moe = RecordModel(layers=48, heads=32, kv_heads=4, hidden=2048, experts=128, qk_norm=True)
    assert tensors_per_token(dense, "rollout") == 28 * 37 + 8
    assert tensors_per_token(dense, "train") == 28 * 30 + 10
    assert tensors_per_token(moe, "rollout") == 48 * 40 + 8  # gate + experts block, q/k norms
    assert tensors_per_token(dense, "rollout", layers=2) == 2 * 37 + 8  # --layers
    size = records(dense, 16, 1536, rollout_tp=2, steps=3)
    assert size.rollout == 16 * 1536 * 2 * 12 * (28 * 37 + 8) and size.run == 3 * size.per_step


def test_model_config_from_a_folder_the_cache_or_said_unknown(hub: Path, tmp_path: Path) -> None:
    found = model_config.read("Qwen/Qwen3-30B-A3B", "script")
    assert found.model is not None and found.model.experts == 128 and found.model.qk_norm
    assert "Hugging Face cache" in found.where
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llava",
                "text_config": {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 64},
            }
        )
    )
    nested = model_config.read(str(folder), "script")
    assert nested.model is not None and nested.model.layers == 4
    for value, origin, says in (
        ("Qwen/Qwen2-7B-Instruktor", "script", "no models--Qwen--Qwen2-7B-Instruktor"),
        ("$MODEL", "script", "names a variable"),
        (None, "runtime", "only known at run time"),
    ):
        unknown = model_config.read(value, origin)
        assert unknown.model is None and says in unknown.where, unknown.where
    assert model_config.valid_tp(28) == [1, 2, 4, 7, 14, 28]


def test_a_tp_that_does_not_divide_the_heads_is_refused(hub: Path, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(
        variant("run_scale_qwen2_7b_8gpu.sh", "vllm").replace(
            f"{R}tensor_model_parallel_size=2", f"{R}tensor_model_parallel_size=8"
        )
    )
    code, out, _ = cli("prepare", str(script), "--mode", "consistency", "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["written"]
    (bad,) = [v for v in doc["violations"] if v["rule"] == "consistency.parallel.tp_divides_heads"]
    assert bad["required"] == "one of 1, 2, 4, 7, 14, 28" and "28 attention heads" in bad["fix"]
    # the original skill's plan sets TP = the 8 devices: refused the same way, not written to fail at start-up
    code, out, _ = cli("prepare", str(tmp_path / "run.sh"), "--mode", "consistency", "--batch-one", "--json")
    assert code == 1 and "consistency.parallel.tp_divides_heads" in {
        v["rule"] for v in json.loads(out)["violations"]
    }


def test_flags_choose_requests_layers_modules_steps_and_check_reads_them(hub: Path, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(variant("run_scale_qwen2_7b_8gpu.sh", "vllm"))
    code, out, err = cli(
        "prepare", str(script), "--mode", "consistency", "--request", "abc123", "--request", "def456",
        "--layers", "0,27", "--modules", "mlp|attn", "--steps", "3", "--json",
    )  # fmt: skip
    doc = json.loads(out)
    assert code == 0, doc["violations"]
    env = {c["key"]: c["required"] for c in doc["changes"]}
    assert env["RL_MSPROBE_RECORD_IDS"] == "abc123,def456" and "RL_MSPROBE_RECORD_SHARE" not in env
    assert env["RL_MSPROBE_RECORD_LAYERS"] == "0,27" and env["RL_MSPROBE_RECORD_MODULES"] == "mlp|attn"
    assert env["trainer.total_training_steps"] == "3"
    note = next(n for n in doc["notes"] if n.startswith("Records: estimated"))
    assert "2 request(s)" in note and "for the run (3 dumped step(s))" in note
    derived = Path(doc["script"]).read_text()
    assert (
        "--request abc123 --request def456"
        in derived.split("rl-msprobe consistency plan:", 1)[1].splitlines()[0]
    )
    assert cli("check", doc["script"], "--mode", "consistency")[0] == 0
    # the same script checked without the header line: the default plan's share is missing
    plain = tmp_path / "plain.sh"
    plain.write_text(
        "\n".join(line for line in derived.splitlines() if "consistency plan:" not in line) + "\n"
    )
    code, out, _ = cli("check", str(plain), "--mode", "consistency", "--json")
    assert code == 1 and "consistency.env.RL_MSPROBE_RECORD_SHARE" in {
        v["rule"] for v in json.loads(out)["violations"]
    }
    assert cli("prepare", str(script), "--mode", "consistency", "--steps", "1,2")[0] == 2
    assert cli("prepare", str(script), "--mode", "consistency", "--modules", "(")[0] == 2
    assert cli("prepare", str(script), "--mode", "consistency", "--request", "a b")[0] == 2


def test_the_default_request_count_shrinks_to_fit_and_says_so(hub: Path, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(variant("run_scale_qwen2_5_32b_16gpu.sh", "vllm"))
    code, out, _ = cli("prepare", str(script), "--mode", "consistency", "--json")
    doc = json.loads(out)
    assert code == 0
    (shrunk,) = [n for n in doc["notes"] if "past the default budget of 5 GiB" in n]
    assert "16 request(s) per dumped step would write" in shrunk
    # asked for explicitly: not shrunk, refused past --max-dump-gib
    code, out, _ = cli(
        "prepare", str(script), "--mode", "consistency", "--requests", "16", "--max-dump-gib", "5", "--json"
    )
    assert code == 1 and [v["rule"] for v in json.loads(out)["violations"]] == ["consistency.dump_size"]


def test_a_share_of_about_one_request_a_step_says_how_likely_an_empty_step_is(
    hub: Path, tmp_path: Path
) -> None:
    """The hash draws each request on its own: at about one request a step, a step records none about
    e^-1 of the time. The plan says so, for the step and the run, and what gives more; at 16 it is quiet."""
    script = tmp_path / "run.sh"
    script.write_text(variant("run_scale_qwen2_7b_8gpu.sh", "vllm"))  # 1024 prompts x n 5 a step
    said = []
    for args in (["--requests", "1"], ["--requests", "1", "--steps", "3"], ["--requests", "16"]):
        code, out, _ = cli("prepare", str(script), "--mode", "consistency", *args, "--json")
        assert code == 0
        said.append([n for n in json.loads(out)["notes"] if "records none with a chance" in n])
    one, three, sixteen = said
    assert len(one) == 1 and "a chance of 37% (the run of 1 dumped step(s): 37%)" in one[0]
    assert "--request ID" in one[0] and "a chance of 37% (the run of 3 dumped step(s): 5%)" in three[0]
    assert sixteen == []


def test_from_checkpoint_keeps_the_resume_and_counts_from_its_step(tmp_path: Path) -> None:
    text = variant("run_scale_qwen2_7b_8gpu.sh", "vllm").replace(
        "trainer.total_epochs=15",
        "trainer.total_epochs=15 trainer.resume_mode=resume_path trainer.resume_from_path=/ckpt/global_step_40",
    )
    script = tmp_path / "run.sh"
    script.write_text(text)
    code, out, _ = cli(
        "prepare", str(script), "--mode", "consistency", "--from-checkpoint", "--steps", "2", "--json"
    )
    doc = json.loads(out)
    assert code == 0, doc["violations"]
    ov = overrides(Path(doc["script"]).read_text())
    assert (
        value(ov, "trainer.total_training_steps") == 42 and value(ov, "trainer.resume_mode") == "resume_path"
    )
    plain = tmp_path / "plain.sh"
    plain.write_text(variant("run_scale_qwen2_7b_8gpu.sh", "vllm"))
    code, out, _ = cli("prepare", str(plain), "--mode", "consistency", "--from-checkpoint", "--json")
    assert code == 1 or any("global_step_K" in u for u in json.loads(out)["unverifiable"])


def test_megatron_records_get_the_layout_their_helper_follows(tmp_path: Path) -> None:
    """The Megatron helper records packed micro-batches per TP rank: with TP > 1 the plan turns
    sequence parallelism off (verl's engine default on), a context parallel size or padded batches the
    script sets are put back, each in the "what differs" block; --prefill-only keeps them all."""
    base = (CORPUS / "run_deepseek_megatron_vllm.sh").read_text()
    script = tmp_path / "run.sh"
    script.write_text(
        base.replace(
            "    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=$TP",
            "    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=$TP\n"
            "    actor_rollout_ref.actor.megatron.context_parallel_size=2\n"
            "    actor_rollout_ref.actor.use_remove_padding=False",
        )
    )

    def changes(*args: str) -> dict[str, str]:
        code, out, err = cli(
            "prepare", str(script), "--mode", "consistency", "--out", str(tmp_path / "o"), *args, "--json"
        )
        doc = json.loads(out)
        assert code == 0, (doc.get("violations"), err)
        return {
            c["rule"]: c["required"]
            for c in doc["changes"]
            if c["rule"].startswith("consistency.records.megatron")
        }

    assert changes() == {
        "consistency.records.megatron_sequence_parallel": "False",
        "consistency.records.megatron_context_parallel": "1",
        "consistency.records.megatron_remove_padding": "True",
    }
    assert changes("--prefill-only", "--force") == {}
