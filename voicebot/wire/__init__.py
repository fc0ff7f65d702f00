"""Codecs of the wires the server speaks, shared by its transports and by the probe
(the client that measures the server from outside): G.711, Twilio/Telnyx media
framing, WebRTC audio frames.

Pure, synchronous functions and small classes over bytes and samples. Imports nothing
of the server, the transports, the sessions or the engines, so a client can use them
without the server's dependencies."""
