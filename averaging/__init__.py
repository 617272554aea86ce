"""shoal.averaging"""
