"""Online packed inference: an HTTP server that packs requests as they arrive.

    python -m finetune.serve --model runs/bbc/model [--policy packed] [--port 8080]

api.py (requests read strictly) -> engines.py (tokenize; one forward; answers) ->
scheduler.py (bounded queue, deadlines, one worker thread) with policies.py (which
sequences run next, in which rows) -> app.py (FastAPI routes, lifecycle) -> metrics.py.
"""
