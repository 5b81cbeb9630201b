"""What every llmgw process shares: wire schemas, subject names, the bus
connection, the PKI, configuration parsing."""
