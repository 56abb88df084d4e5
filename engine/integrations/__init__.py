"""What makes other libraries' scripts run on the engine: DeepSpeed (:mod:`engine.integrations.deepspeed`)
and Hugging Face's transformers, accelerate and PEFT (:mod:`engine.integrations.hf`)."""
