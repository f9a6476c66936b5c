"""What validation logs from its datasets: val/accuracy, its standard error (val/accuracy_stderr, read by the collapse
monitor's val_drop_se) and the legacy keys from the primary dataset, and with a
dataset list every dataset's metrics under val/<name>/."""

from megatron_armor.trainer.step.validation import DatasetResult, validation_metrics


def result(name, avg):
    return DatasetResult(name, [], {"avg@4": avg, "avg@4_stderr": 0.01, "pass@4": 0.9, "reward_mean": 2 * avg,
                                    "response_length": 10.0, "truncated_fraction": 0.0, "aborted_fraction": 0.0})


def test_single_dataset_logs_the_keys_validation_always_logged_and_the_accuracy_stderr():
    assert validation_metrics([result("val", 0.25)], per_dataset=False) == {
        "val/accuracy": 0.25, "val/accuracy_stderr": 0.01, "val/reward_mean": 0.5, "val/response_length": 10.0,
        "val/aborted_fraction": 0.0}


def test_dataset_list_logs_every_dataset_and_the_primary_as_val_accuracy():
    metrics = validation_metrics([result("math", 0.25), result("gsm", 0.5)], per_dataset=True, primary=1)
    assert metrics["val/accuracy"] == 0.5 and metrics["val/reward_mean"] == 1.0
    assert metrics["val/math/avg@4"] == 0.25 and metrics["val/gsm/pass@4"] == 0.9
    assert len(metrics) == 5 + 2 * 7
