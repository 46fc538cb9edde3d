"""Moved: the model runner to jpaged.worker.model_runner, `start_runner` to
jpaged.engine.backend_choice. The old names are kept for one release."""

from jpaged._deprecation import moved_names

__getattr__ = moved_names(__name__, {
    **{name: "jpaged.worker.model_runner" for name in (
        "ModelRunner", "AttentionBackend", "StepFunctions", "step_functions",
        "STEP_FUNCTIONS_CACHE_SIZE", "attention_functions", "device_attention_backend")},
    "default_attention_backend": "jpaged.worker.model_runner:device_attention_backend",
    "start_runner": "jpaged.engine.backend_choice",
})
