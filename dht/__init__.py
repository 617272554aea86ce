"""shoal.dht"""
