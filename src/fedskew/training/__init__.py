"""What an algorithm is written against: messages (protocol), the client and server
interfaces, and the local training loop."""
