"""The fleet panel: several vLLM / SGLang / KVScope servers watched at once."""
