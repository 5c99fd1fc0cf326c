"""The OpenAI-compatible HTTP front-end (`kvscope serve`): one more client of the engine.

It runs in its own process (or beside the window as a child of the GUI), talks to the engine over
the ZeroMQ protocol like every other client, and never imports torch or Qt:

    settings.py   the server's settings (bounds, keys, names) and what a loopback host is
    guard.py      Host check and API key before any route (pure ASGI), bounded JSON bodies
    errors.py     OpenAI error bodies and status codes
    requests.py   request bodies -> validated generation plans (400 naming the field)
    generation.py one generation over the engine client; responses.py, streaming.py: replies
    responses.py  engine replies -> OpenAI response objects and stream chunks
    chat_output.py a chat choice's text -> content, reasoning, tool calls (ChoiceReader), whole
                  and streamed; reasoning.py the <think> split; tools/ the tool fields of a
                  request (request.py), the families' parsers, the forced-choice schema
    openai_responses.py, anthropic_messages.py  the Responses and Messages APIs' requests ->
                  chat plans (through chat_body.py); responses_stream.py, messages_stream.py
                  their replies, whole and streamed; agent_runs.py drives one chat choice
                  through either; agent_routes.py their routes
    metrics.py    telemetry snapshots -> Prometheus text (vLLM's names, `kvscope:` prefix)
    server.py     the ASGI app: routes, limits, disconnects
    keeper.py     the hold on the engine: spawn or attach, restart, reattach

The command itself, `kvscope serve` / `python -m app serve`, is app/serve.py (it also builds the
disaggregated deployment of app/router/).
"""
