"""What crosses the wire: the tensor codec and envelope, protocol messages, assignments, signatures."""
