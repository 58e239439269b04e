claude mcp add cube -- cube-adapter mcp \
  --url https://cube.example.internal:18080 \
  --token-file $HOME/.config/cube-adapter/token \
  --ca-file $HOME/.config/cube-adapter/ca.pem \
  --profile offline-code --runtime mcp
