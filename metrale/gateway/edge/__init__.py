"""What a request passes through before a route reads it: the HTTP server and its protocols (read
timeouts, the connection cap), and the ASGI layers around the app — ``/health`` first, the access log,
load shedding, API keys, the body size limit and precheck, and the cancel of a request whose client left.
"""
