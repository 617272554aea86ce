"""Identity, addresses, secure channel, stream multiplexing, RPC and the host.

Importing this package never imports torch: tensor support loads it lazily.
"""
