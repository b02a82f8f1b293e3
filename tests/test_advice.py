"""The advice rules (keras_scale.advice): each fires on the numbers it is about and stays silent otherwise, and
its message points to the fix. Pure functions on fabricated epoch statistics: no TensorFlow, no NVML."""
import pytest

from keras_scale import advice as adv
from keras_scale.advice import AdviceThresholds, EpochStats
from keras_scale.nvml import GpuProcess

TH = AdviceThresholds()


def _stats(util=None, cpu=None, mem=None, total=16000.0, meaningful=True, mixed=False, jit=False,
           input_rate=None, **gpu):
    g = dict(gpu)
    if util is not None:
        g["util_mean"] = util
    if mem is not None:
        g.update(mem_max_mb=mem, mem_total_mb=total)
    return EpochStats(epoch=0, gpus={0: g}, host_cpu_mean_pct=cpu, timing={"steps_per_s": 4.0,
                      "step_time_mean_ms": 250.0}, mixed_precision=mixed, jit_compile=jit,
                      memory_readings_meaningful=meaningful, input_batches_per_s=input_rate)


@pytest.mark.parametrize("rule,stats,fires", [
    (adv.input_bound_rule, _stats(util=20, cpu=95), True),
    (adv.input_bound_rule, _stats(util=20, cpu=30), False),  # host idle: not the input pipeline's CPU
    (adv.input_bound_rule, _stats(util=80, cpu=95), False),  # GPU busy
    (adv.input_bound_rule, _stats(util=20, cpu=None), False),  # no host reading: say nothing
    (adv.input_bound_rule, _stats(util=20, cpu=95, input_rate=40.0), False),  # pipeline measured 10x faster
    (adv.input_bound_rule, _stats(util=20, cpu=95, input_rate=5.0), True),
    (adv.input_rate_rule, _stats(util=20, input_rate=4.5), True),  # 4.5 batches/s vs 4 steps/s
    (adv.input_rate_rule, _stats(util=20, input_rate=20.0), False),
    (adv.input_rate_rule, _stats(util=20), False),  # not measured: silent
    (adv.gpu_idle_rule, _stats(util=20, cpu=30), True),
    (adv.gpu_idle_rule, _stats(util=20, cpu=95), False),
    (adv.gpu_idle_rule, _stats(util=70, cpu=10), False),
    (adv.compute_bound_rule, _stats(util=97), True),
    (adv.compute_bound_rule, _stats(util=97, mixed=True), True),  # XLA still off
    (adv.compute_bound_rule, _stats(util=97, mixed=True, jit=True), False),  # nothing left to suggest
    (adv.compute_bound_rule, _stats(util=60), False),
    (adv.memory_rule, _stats(mem=15800.0), True),
    (adv.memory_rule, _stats(mem=15800.0, meaningful=False), False),  # TF reserved it all: says nothing
    (adv.memory_rule, _stats(mem=8000.0), False),
    (adv.throttle_rule, _stats(throttle_thermal_frac=0.5, temp_max_c=91.0), True),
    (adv.throttle_rule, _stats(throttle_power_cap_frac=0.3, power_max_w=299.0, power_limit_w=300.0), True),
    (adv.throttle_rule, _stats(throttle_hw_slowdown_frac=0.25), True),
    (adv.throttle_rule, _stats(throttle_thermal_frac=0.1, throttle_power_cap_frac=0.05), False),
    (adv.throttle_rule, _stats(util=99), False),
])
def test_each_rule_fires_and_stays_silent(rule, stats, fires):
    advice = rule(stats, TH)
    assert bool(advice) == fires
    for a in advice:
        assert a.message and a.kind


def test_advice_messages_point_to_the_fix():
    (inp,) = adv.input_bound_rule(_stats(util=20, cpu=95), TH)
    assert "prefetch" in inp.message and "num_parallel_calls" in inp.message and "ProfileWindow" in inp.message
    assert "keras_scale.data.benchmark" in inp.message and "4.00 steps/s" in inp.message
    (cb,) = adv.compute_bound_rule(_stats(util=97, mixed=True), TH)
    assert "jit_compile=True" in cb.message and "mixed" not in cb.message.split("less work per sample")[1]
    (mem,) = adv.memory_rule(_stats(mem=15800.0), TH)
    assert "accum" in mem.message and "99%" in mem.message and mem.gpu_index == 0
    (thr,) = adv.throttle_rule(_stats(throttle_thermal_frac=0.5, temp_max_c=91.0), TH)
    assert "cooling" in thr.message and "91 C" in thr.message and "power limit" not in thr.message
    (pwr,) = adv.throttle_rule(_stats(throttle_power_cap_frac=0.5), TH)
    assert "power limit" in pwr.message and "cooling" not in pwr.message


def test_thresholds_are_configurable():
    assert adv.input_bound_rule(_stats(util=40, cpu=95), AdviceThresholds(low_util_pct=30.0)) == []
    assert adv.input_bound_rule(_stats(util=20, cpu=95), AdviceThresholds(low_util_pct=30.0))




def test_leftover_processes_message_names_each_process_and_the_free_gpus():
    procs = [GpuProcess(0, 4242, "python old.py", 10240.0), GpuProcess(2, 4243, "python other.py", None),
             GpuProcess(0, 4242, "python old.py", 10240.0)]
    what, fix = adv.leftover_processes_message(procs, [0, 1, 2, 3])
    assert "GPU 0: pid 4242 (python old.py) holds 10240 MiB" in what and "GPU 2: pid 4243" in what
    assert "holds ? MiB" in what  # memory not readable (container): said so, not 0
    assert "kill 4242 4243" in fix and "ps -fp 4242,4243" in fix and "CUDA_VISIBLE_DEVICES=1,3" in fix
    _, busy = adv.leftover_processes_message(procs, [0, 2])
    assert "choose other GPUs" in busy
