"""Prefill/decode disaggregation in front of two engines: the router that sends each request
through both, and the deployment that keeps the two engines (`kvscope serve --disaggregated`)."""
