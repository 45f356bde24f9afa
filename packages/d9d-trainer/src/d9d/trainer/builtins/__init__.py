"""The built-in providers, named in a config like a user's own (`d9d.trainer:CausalLMTask`): the causal-LM
task; AdamW/SGD with warmup and cosine/linear/constant schedules; AutoDataProvider; the model d9d ships
(`ReferenceModelProvider`) and a Hugging Face folder (`HFModelProvider`); conversations, text and
prepared folders as datasets."""
