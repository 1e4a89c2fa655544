"""eaglet's OpenAI-compatible server, room by room: fields.py checks each field of a request, requests.py turns a
request into the engine's Jobs, engine.py runs them (metrics.py counts), replies.py shapes what comes back in OpenAI's
objects, app.py is the HTTP routes and the shutdown; `python serve.py` (at the top) is the command.
"""
