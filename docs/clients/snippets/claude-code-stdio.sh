claude mcp add cube \
  --env CUBE_ADAPTER_URL=https://cube.example.internal:18080 \
  --env CUBE_ADAPTER_TOKEN_FILE=$HOME/.config/cube-adapter/token \
  --env CUBE_ADAPTER_CA_FILE=$HOME/.config/cube-adapter/ca.pem \
  --env CUBE_ADAPTER_PROFILE=offline-code \
  -- cube-adapter mcp
