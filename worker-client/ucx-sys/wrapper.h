/* The headers ucx-sys binds: UCP (and the UCS status type it returns). */
#include <ucp/api/ucp.h>
